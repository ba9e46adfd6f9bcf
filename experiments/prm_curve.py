"""Learning curve of a tiny PRM on generated synthetic solutions, on one fixed held-out set.

    python experiments/prm_curve.py --init runs/learning/seed0/sft/best --steps 320 [--pairs]
        [--extra-layers-from 0 1 --new-layer-lr 1e-3] [--seed 7]

Trains with a plain torch loop (the same loss functions as `igrpo train-rm`, without DeepSpeed) so
that recipes can be compared step for step, and prints step accuracy and AUROC every
`--eval-every` steps on 500 held-out solutions (RL questions 40,000-40,499, half with one slip):
the same set for every run, unlike each `train-rm` run's own validation split.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from configs import load_config  # noqa: E402
from reward_model.backbone import added_layer_parameters, deepen  # noqa: E402
from reward_model.encoding import encode, tag_tokens  # noqa: E402
from reward_model.examples import synthetic_step_examples  # noqa: E402
from reward_model.losses import lm_loss_sum, tag_logit_margin, tag_loss  # noqa: E402
from reward_model.score import TagScorer  # noqa: E402
from reward_model.evaluate import step_metrics  # noqa: E402
from reward_model.train import question_groups  # noqa: E402
from runtime.training import seeded_order  # noqa: E402
from runtime.data import load_splits  # noqa: E402
from runtime.models import load_causal_lm, load_tokenizer  # noqa: E402

TAG = "ки"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--init", default="runs/learning/seed0/sft/best")
    p.add_argument("--steps", type=int, default=320)
    p.add_argument("--eval-every", type=int, default=80)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--lm-weight", type=float, default=1.0)
    p.add_argument("--extra-layers-from", type=int, nargs="*", default=[])
    p.add_argument("--new-layer-lr", type=float, default=1e-3)
    p.add_argument("--pairs", action="store_true", help="minimal pairs, side by side in batches")
    p.add_argument("--seed", type=int, default=1, help="training data and order")
    a = p.parse_args()
    torch.set_num_threads(2)
    records = load_splits(load_config("configs/tiny.yaml", []).data, 0).rl
    train = synthetic_step_examples(records[:10000] if a.pairs else records[:20000], a.seed,
                                    paired=a.pairs)
    held_out = synthetic_step_examples(records[40000:40500], 2)
    tokenizer = load_tokenizer(a.init)
    tokenizer.padding_side = "right"
    model = load_causal_lm(a.init)
    deepen(model, a.extra_layers_from)
    fresh = {id(q) for q in added_layer_parameters(model)}
    optimizer = torch.optim.AdamW(
        [{"params": [q for q in model.parameters() if id(q) not in fresh], "lr": a.lr},
         {"params": [q for q in model.parameters() if id(q) in fresh], "lr": a.new_layer_lr}],
        weight_decay=0.0)
    tags = tag_tokens(tokenizer, TAG)
    scorer = TagScorer(model, tokenizer, TAG, 256)

    def report(step: int, started: float) -> None:
        m = step_metrics(scorer.score(held_out), [list(ex.labels) for ex in held_out])
        print(f"step {step:4d}  {time.perf_counter() - started:6.0f} s  "
              f"step accuracy {m['step_accuracy']:.3f}  AUROC {m['auroc']:.3f}", flush=True)

    order = seeded_order(len(train), a.seed, question_groups(train) if a.pairs else None)
    started = time.perf_counter()
    report(0, started)
    model.train()
    for step in range(1, a.steps + 1):
        rows = [train[i] for i in order[(step - 1) * a.batch_size:step * a.batch_size]]
        batch = encode(tokenizer, rows, tags, TAG, 256, lm_targets=a.lm_weight > 0)
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        loss = tag_loss(tag_logit_margin(logits, tags.plus_id, tags.minus_id), batch.targets,
                        batch.label_mask)
        if a.lm_weight:
            loss = loss + a.lm_weight * lm_loss_sum(logits, batch.input_ids, batch.lm_mask) \
                / batch.lm_mask[:, 1:].sum().clamp(min=1)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % a.eval_every == 0:
            report(step, started)


if __name__ == "__main__":
    main()
