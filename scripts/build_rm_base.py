"""Build (or rebuild and check) the shipped reward-model base, runtime/bundled/tiny_rm_base.

The tiny analogue of DeepSeekMath-Base for the reward models: the paper starts its reward models
from a base model pretrained on math text, not from the instruct policy. Here the base is the
shipped warm start made twice as deep (its 4 layers copied on top with zero output,
`reward_model/backbone.py`: exactly the warm start's function at first) and then trained on as a
language model on the task's text, the SFT split's worked solutions (40% by the student who
forgets to carry and borrow), with `igrpo sft`. Predicting the next step of such text pays for
telling the two students apart from the steps so far, which is what checking a step needs; the
added layers are where a 4-layer policy has room to do it (docs/reward_models.md).

    python scripts/build_rm_base.py              # deepen, train, measure, bundle (~13 min)
    python scripts/build_rm_base.py --check --run runs/rm-base-2   # train again, compare
    python scripts/build_rm_base.py --from-run                     # package the run in --run

`rm.init_path=bundled:tiny_rm_base` starts both reward models from it. The bundle holds the model,
its tokenizer and `recipe.json`: the commands, the SFT run's record, the weights' sha256 and the
recorded numbers (`heldout_lm`: teacher-forced next-token loss and accuracy on 100 held-out
questions' right solutions and on the slipping student's; tests/test_rm_base.py recomputes them).
A rebuild matches within float noise, not bitwise; `--check` prints it beside the shipped one and
exits 1 when it is not nearer the shipped base than half the way to the warm start.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import igrpo  # noqa: E402
from build_warm_start import write_bundle  # noqa: E402
from configs import load_config  # noqa: E402
from reward_model.backbone import heldout_lm  # noqa: E402

BUNDLE = ROOT / "runtime" / "bundled" / "tiny_rm_base"
WARM = ROOT / "runtime" / "bundled" / "tiny_warm_start"
CONFIG = "configs/tiny.yaml"
COPIED_LAYERS = [0, 1, 2, 3]
# `igrpo sft` on the deepened warm start: half an epoch of the SFT split at 5e-4 decaying to 0.
RECIPE = ["sft.enabled=true", "sft.lr=5e-4", "sft.epochs=0.5", "sft.export_final=true",
          "run.wandb_mode=disabled"]


def deepened(root: Path) -> Path:
    """The warm start with `COPIED_LAYERS` added on top, saved in `root/deepened`."""
    from reward_model.backbone import deepen
    from runtime.models import load_causal_lm, load_tokenizer

    out = root / "deepened"
    model = load_causal_lm(WARM)
    deepen(model, COPIED_LAYERS)
    model.save_pretrained(out)
    load_tokenizer(WARM).save_pretrained(out)
    return out


def check_failures(shipped: dict, numbers: dict) -> int:
    """`--check`'s exit code. A rebuild matches when, on both texts, its per-token NLL lies
    nearer the shipped base's than half the way from the shipped base to the warm start (what the
    base's training moved); 1 when it does not, or when it is no longer below the warm start's."""
    off = []
    for text in ("right", "slipped"):
        base, rebuilt, warm = (n[text]["nll_per_token"]
                               for n in (shipped, numbers["base"], numbers["warm_start"]))
        if abs(rebuilt - base) > abs(warm - base) / 2 or rebuilt >= warm:
            off.append(text)
            print(f"rebuild differs from the shipped base on the {text} solutions: NLL/token "
                  f"{rebuilt:.4f}, shipped {base:.4f}, warm start {warm:.4f}")
    return 1 if off else 0


def command(root: Path) -> list[str]:
    return ["sft", "--config", CONFIG, f"run.root={root}", "run.name=lm",
            f"model.policy_path={root / 'deepened'}", *RECIPE]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", type=Path, default=ROOT / "runs" / "rm-base")
    parser.add_argument("--from-run", action="store_true",
                        help="package the run already in --run instead of training")
    parser.add_argument("--check", action="store_true",
                        help="compare with the shipped bundle instead of replacing it")
    args = parser.parse_args()
    seconds = None
    if not args.from_run:
        start = time.perf_counter()
        deepened(args.run)
        if igrpo.main(command(args.run)) != 0:
            raise SystemExit("igrpo sft failed")
        seconds = time.perf_counter() - start
    run = args.run / "lm" / "sft"
    final = run / "final"  # the language model at its end (`best` is chosen by greedy accuracy)
    cfg = load_config(CONFIG, [])
    numbers = {"warm_start": heldout_lm(WARM, cfg.data, cfg.run.seed),
               "base": heldout_lm(final, cfg.data, cfg.run.seed)}
    if args.check:
        shipped = json.loads((BUNDLE / "recipe.json").read_text())["heldout_lm"]["base"]
        for text in ("right", "slipped"):
            for key in ("nll_per_token", "token_accuracy"):
                print(f"{text:>7} {key:>15}: shipped {shipped[text][key]:.4f}  rebuilt "
                      f"{numbers['base'][text][key]:.4f}  warm start "
                      f"{numbers['warm_start'][text][key]:.4f}")
        return check_failures(shipped, numbers)
    write_bundle(final, BUNDLE, {
        "commands": ["python scripts/build_rm_base.py (deepen the warm start: layers "
                     f"{COPIED_LAYERS} copied on top)",
                     " ".join(["igrpo", *command(Path("runs/rm-base"))])],
        "config": (run / "config.yaml").read_text(),
        "sft": json.loads((run / "done.json").read_text()),
        "seconds": seconds, "heldout_lm": numbers})
    print(json.dumps(numbers, indent=2))
    print(f"wrote {BUNDLE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
