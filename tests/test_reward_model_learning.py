"""Slow: a tiny PRM and ORM trained for CPU minutes on generated synthetic solutions learn, and
the CLI trains a PRM alone from a Math-Shepherd JSONL file and reloads it to identical scores."""

import json

import pytest

import igrpo
from process_supervision.formats import write_math_shepherd_jsonl
from reward_model.examples import as_orm, synthetic_step_examples
from reward_model.report import best_of_n_report, labelled_report
from reward_model.score import TagScorer
from runtime.data import load_splits
from runtime.tiny_model import load_causal_lm, load_tokenizer
from configs import load_config

RM = ["rm.lr=1e-3", "rm.batch_size=32", "rm.epochs=2", "rm.synthetic_solutions=3000",
      "rm.eval_every=0", "deepspeed.micro_batch_size=32", "run.wandb_mode=disabled",
      "run.threads=2", "data.eval_questions=200", "rm.eval_solutions=200",
      "rm.bon_questions=100", "rm.bon_samples=16"]


@pytest.mark.slow
def test_tiny_prm_and_orm_learn_and_pick_better_samples(warm_start, tmp_path):
    for kind in ("prm", "orm"):
        assert igrpo.main(["train-rm", "--config", "configs/tiny.yaml", f"run.root={tmp_path}",
                           f"rm.kind={kind}", f"rm.init_path={warm_start}", *RM]) == 0
    cfg = load_config("configs/tiny.yaml", [f"run.root={tmp_path}", *RM])
    splits = load_splits(cfg.data, cfg.run.seed)
    held_out = synthetic_step_examples(splits.eval, seed=99)
    scorers = {kind: TagScorer.from_pretrained(tmp_path / "tiny" / f"rm-{kind}" / "final",
                                               cfg.rm.step_tag, cfg.rm.max_length)
               for kind in ("prm", "orm")}
    prm = labelled_report(scorers["prm"], held_out)
    orm = labelled_report(scorers["orm"], as_orm(held_out))
    policy = load_causal_lm(warm_start).eval()
    bon = best_of_n_report(policy, load_tokenizer(warm_start), splits.eval[:100],
                           cfg.data.prompt_template, {k: (s, k) for k, s in scorers.items()},
                           "min", 16, temperature=1.0, max_new_tokens=48)
    print(json.dumps({"prm": prm, "orm": orm, "bon": bon}, indent=1))
    assert prm["step_accuracy"] >= 0.85
    assert orm["step_accuracy"] >= 0.80  # one 'step' per solution: solution accuracy
    assert bon["prm_pick"] - bon["random"] >= 0.10


@pytest.mark.slow
def test_train_rm_cli_from_math_shepherd_file(tmp_path):
    cfg = load_config("configs/tiny.yaml", ["data.rl_questions=300"])
    examples = synthetic_step_examples(load_splits(cfg.data, 0).rl, seed=3)
    data = tmp_path / "prm.jsonl"
    write_math_shepherd_jsonl(data, examples)
    small = ["model.tiny.hidden_size=32", "model.tiny.num_layers=1", "model.tiny.num_heads=2",
             "model.tiny.intermediate_size=64", "rm.epochs=1", "rm.batch_size=16",
             "deepspeed.micro_batch_size=16", "run.wandb_mode=disabled", f"rm.data_path={data}",
             "rm.kind=prm", "rm.eval_every=5"]
    assert igrpo.main(["train-rm", "--config", "configs/tiny.yaml", f"run.root={tmp_path}",
                       *small]) == 0
    final = tmp_path / "tiny" / "rm-prm" / "final"
    rows = [json.loads(line) for line in open(tmp_path / "tiny" / "rm-prm" / "metrics.jsonl")]
    assert "rm/val_step_accuracy" in rows[-1] and rows[-1]["rm/loss"] > 0
    done = json.loads((tmp_path / "tiny" / "rm-prm" / "done.json").read_text())
    a = TagScorer.from_pretrained(final, "ки", 512).score(examples[:20])
    b = TagScorer.from_pretrained(final, "ки", 512).score(examples[:20])
    assert a == b and [len(x) for x in a] == [len(ex.steps) for ex in examples[:20]]
    assert done["step_accuracy"] == pytest.approx(
        labelled_report(TagScorer.from_pretrained(final, "ки", 512),
                        _validation(examples, cfg))["step_accuracy"])


def _validation(examples, cfg):
    from reward_model.train import split_validation

    return split_validation(examples, cfg.rm.val_fraction, cfg.run.seed)[1]
