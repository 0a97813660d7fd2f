"""The trainer as its own process (what `swerve train` launches):

    python -m trainer --config trainer/configs/debug.toml [--steps=2 --loss.kl_coef=0.01 ...]
    python -m trainer --config F --nproc 2 --parallelism.world_size=2    # torchrun underneath
    python -m trainer --config F --check                                 # the layout, on the meta device

Prints one JSON line per step on rank 0; exits 2 on a bad config.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
from pathlib import Path

from pydantic import ValidationError

from service.config import SettingsError, get_settings
from service.log import setup_logging
from trainer.config import TrainerConfig, load_config

PRINTED = ("step", "loss", "reward_mean", "mismatch_kl", "tokens")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m trainer", allow_abbrev=False,
                                     description="Train on the buffer's ready groups, publish each new policy "
                                                 "and reload the fleet. Extra --section.key=value arguments "
                                                 "override the config.")
    parser.add_argument("--config", type=Path, required=True, help="Trainer config (TOML).")
    parser.add_argument("--nproc", type=int, default=1, help="Processes on this machine (torchrun); the config's "
                                                             "parallelism.world_size must match the whole job's.")
    parser.add_argument("--check", action="store_true", help="Check the model and parallel layout on the meta "
                                                             "device, print it and exit.")
    parser.add_argument("--validate", action="store_true", help="Check the config only: print it resolved as "
                                                                "JSON, or one line per error (field: problem).")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args, overrides = parser.parse_known_args(argv)
    if not args.config.is_file():
        parser.error(f"--config {args.config}: no such file")
    if args.nproc < 1:
        parser.error("--nproc must be at least 1")
    if args.nproc > 1 and not args.check and "WORLD_SIZE" not in os.environ:  # torchrun starts this N times
        os.execv(sys.executable, [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                  f"--nproc_per_node={args.nproc}", "-m", "trainer", f"--config={args.config}",
                                  *overrides])
    if args.validate:
        return _validate(args.config, overrides)
    try:
        cfg = load_config(args.config, overrides)
        if args.check:
            return _check(cfg)
        settings = get_settings()
    except SettingsError as e:
        print(e, file=sys.stderr)
        return 2
    except (ValueError, ValidationError) as e:
        print(f"{args.config}: {e}", file=sys.stderr)
        return 2
    from trainer.train import train

    setup_logging(settings.log_format)
    history = asyncio.run(train(cfg, cfg.database_url or settings.resolved_database_url))
    if os.environ.get("RANK", "0") == "0":
        for m in history:
            print(json.dumps({k: m[k] for k in PRINTED}), flush=True)
    return 0


def _validate(path: Path, overrides: list[str]) -> int:
    try:
        cfg = load_config(path, overrides)
    except ValidationError as e:
        for err in e.errors():
            what = "unknown key" if err["type"] == "extra_forbidden" else err["msg"]
            print(f"{'.'.join(str(p) for p in err['loc'])}: {what}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"(config): {e}", file=sys.stderr)
        return 2
    print(cfg.model_dump_json())
    return 0


def _check(cfg: TrainerConfig) -> int:
    from trainer.layout import check

    print(json.dumps(dataclasses.asdict(check(cfg))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
