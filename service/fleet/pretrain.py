"""Pretraining a tiny model made here into a start a policy can be fine-tuned from: one that
copies.

A coding agent copies all the time: the path the issue names into its first call, the line it
viewed into `old_str`. A random 1M-parameter model cannot, and SFT on a few hundred
demonstrations does not teach it (bench/RESULTS.md, "Copy probe": no induction head formed in
9M tokens of demonstrations and text). Two things make one form within minutes on 2 cores:

- the model's shape (TinyModelSpec): tied embeddings, and Qwen3's query/key RMSNorms started
  below 1 (`qk_norm_init`) and trained at a higher learning rate (`norm_lr_mult`); with them at
  1, attention starts too sharp and no copying circuit formed in thousands of steps;
- the data, in two phases: first rows of random tokens repeated with a random period (only
  copying predicts the repeats), then a mix of those and synthetic software text (`code_doc`):
  modules listed as `cat -n` prints them, prose that names files and calls in backticks, JSON
  records and unified diffs that copy a listed line with one change, so copying carries over to
  the text an agent reads and writes.

No demonstration, task of a generated family, chat template or tool-call markup is in the data:
this is what a pretrained model would bring, made small. The result is a model folder (weights,
tokenizer, chat template) the demo's SFT starts from.

    python -m service.fleet.pretrain OUT [--seed 0] [--layers 4]
"""

from __future__ import annotations

import json
import math
import random
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

# ---- synthetic software text ---------------------------------------------------------------

_ONSETS = ("b", "br", "c", "ch", "d", "f", "g", "gr", "h", "j", "k", "l", "m", "n", "p", "pl", "qu", "r", "s",
           "sh", "sk", "st", "t", "th", "tr", "v", "w", "z")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ea", "oo", "ou", "y")
_CODAS = ("", "", "", "n", "r", "l", "s", "t", "ck", "m", "x", "nd", "st")
_VERBS = ("get", "set", "make", "load", "parse", "read", "count", "find", "merge", "split", "scale", "check",
          "build", "apply", "pick", "sum", "fold", "clip", "pad", "trim", "join", "rank", "sort", "fill")
_OPS = ("+", "-", "*", "//", "%")
_CMPS = ("<", "<=", ">", ">=", "==", "!=")
_KEYS = (("path", "file", "filename", "target"), ("old", "old_str", "before", "find", "search"),
         ("new", "new_str", "after", "replace", "replacement"))
"""Spellings of an edit record's three fields: the file, the line as it is, the line as it becomes."""
_PROSE = (
    "The function `{fn}` in `{path}` is called as `{call}`.",
    "See `{path}`: `{fn}` is defined there.",
    "`{call}` gives {a}, not {b}.",
    "Calling `{call}` from `{path}` returns {a}.",
    "We should look at `{fn}` ({path}) before changing `{other}`.",
    "In `{path}`, `{other}` calls `{fn}`.",
    "Running `{call}` printed {a} while the docs say {b}.",
    "`{fn}` lives in `{path}`; `{other}` is next to it.",
)


def word(r: random.Random, syllables: tuple[int, int] = (1, 3)) -> str:
    return "".join(r.choice(_ONSETS) + r.choice(_VOWELS) + r.choice(_CODAS)
                   for _ in range(r.randint(*syllables)))


def ident(r: random.Random) -> str:
    style = r.random()
    if style < 0.4:
        return f"{r.choice(_VERBS)}_{word(r)}"
    if style < 0.7:
        return f"{word(r)}_{word(r, (1, 2))}"
    return word(r, (2, 3))


def _expr(r: random.Random, args: list[str]) -> str:
    a = r.choice(args)
    kind = r.random()
    if kind < 0.35:
        return f"{a} {r.choice(_OPS)} {r.choice(args + [str(r.randint(1, 99))])}"
    if kind < 0.6:
        return f"{r.choice(('min', 'max'))}({a}, {r.choice(args + [str(r.randint(0, 50))])})"
    if kind < 0.8:
        return f"{a} {r.choice(_CMPS)} {r.choice(args + [str(r.randint(0, 99))])}"
    return f"[{word(r, (1, 1))} {r.choice(_OPS)} {r.randint(1, 9)} for {word(r, (1, 1))} in range({a})]"


def function(r: random.Random, name: str) -> list[str]:
    args = list(dict.fromkeys(ident(r) if r.random() < 0.3 else word(r, (1, 2)) for _ in range(r.randint(1, 3))))
    head = f"def {name}({', '.join(args)}{', ' + word(r, (1, 2)) + '=' + str(r.randint(0, 100)) if r.random() < 0.3 else ''}):"
    body, local = [], list(args)
    for _ in range(r.randint(1, 4)):
        form = r.random()
        if form < 0.4:
            v = word(r, (1, 2))
            body.append(f"    {v} = {_expr(r, local)}")
            local.append(v)
        elif form < 0.7:
            body += [f"    if {r.choice(local)} {r.choice(_CMPS)} {r.randint(0, 99)}:",
                     f"        return {_expr(r, local)}"]
        else:
            v = word(r, (1, 2))
            body += [f"    for {v} in range({r.choice(local)}):", f"        {r.choice(local)} += {v}"]
    body.append(f"    return {_expr(r, local)}")
    if r.random() < 0.3:
        body.insert(0, f'    """{r.choice(_VERBS).capitalize()} the {word(r)} of {args[0]}."""')
    return [head, *body]


def module(r: random.Random) -> tuple[list[str], list[str]]:
    """(lines, function names) of one Python module."""
    names = list(dict.fromkeys(ident(r) for _ in range(r.randint(2, 4))))
    lines = []
    if r.random() < 0.5:
        lines += [f"import {r.choice(('math', 'os', 're', 'json', 'itertools'))}", ""]
    if r.random() < 0.4:
        lines += [f"{word(r).upper()} = {r.randint(1, 999)}", ""]
    for n in names:
        lines += function(r, n) + ["", ""]
    return lines[:-2], names


_SWAPS = {"<=": "<", "<": "<=", ">=": ">", ">": ">=", "==": "!=", "!=": "==", "min": "max", "max": "min",
          "+": "-", "-": "+", "*": "+", "//": "/"}
_SWAPPABLE = re.compile(r"<=|>=|==|!=|//|(?<![<>=!/])[<>+*-](?![=/])|(?<![\w])(?:min|max)(?=\()")


def mutate(r: random.Random, line: str) -> str | None:
    """The line with one change of the kinds bugs are made of (an operator or min/max swapped,
    a digit moved by one), or None if it has none."""
    options = [line[:m.start()] + _SWAPS[m.group(0)] + line[m.end():] for m in _SWAPPABLE.finditer(line)]
    options += [line[:m.start()] + str((int(m.group(0)) + 1) % 10) + line[m.end():]
                for m in re.finditer(r"\d(?!\d)", line)]
    options = [o for o in dict.fromkeys(options) if o != line]
    return r.choice(options) if options else None


def numbered(lines: list[str]) -> str:
    return "\n".join(f"{i:6}\t{line}" for i, line in enumerate(lines, 1))


def _prose(r: random.Random, path: str, names: list[str], others: list[str]) -> str:
    fn = r.choice(names)
    call = f"{fn}({', '.join(str(r.randint(0, 30)) for _ in range(r.randint(1, 3)))})"
    return r.choice(_PROSE).format(fn=fn, path=path, call=call, other=r.choice(others), a=r.randint(0, 99),
                                   b=r.randint(0, 99))


def _edit(r: random.Random, path: str, lines: list[str]) -> str | None:
    """A JSON edit record or a unified diff changing one line of `lines`, or None."""
    order = list(range(len(lines)))
    r.shuffle(order)
    for i in order:
        new = mutate(r, lines[i])
        if new is not None:
            break
    else:
        return None
    if r.random() < 0.6:
        keys = [r.choice(spellings) for spellings in _KEYS]
        record = {keys[0]: path, keys[1]: lines[i], keys[2]: new}
        if r.random() < 0.3:
            record = {"name": r.choice(("edit", "replace", "patch")), "arguments": record}
        return json.dumps(record)
    lo = max(0, i - 3)
    before, after = lines[lo:i], lines[i + 1:i + 4]
    n = len(before) + 1 + len(after)
    return "\n".join([f"--- a/{path}", f"+++ b/{path}", f"@@ -{lo + 1},{n} +{lo + 1},{n} @@",
                      *(" " + x for x in before), "-" + lines[i], "+" + new, *(" " + x for x in after)])


def code_doc(r: random.Random) -> str:
    """One document of synthetic software text, rich in copying: a small repository's files
    named in prose, listed, then edited by records and diffs that copy their lines, and named
    again; what is copied was always shown earlier in the document."""
    pkg = word(r, (1, 3)) + r.choice(("", "", "lib", "kit", "_utils", "py"))
    files = []
    for _ in range(r.randint(1, 3)):
        lines, names = module(r)
        files.append((f"{pkg}/{word(r, (1, 2))}.py" if r.random() < 0.85 else f"{word(r, (1, 2))}.py", lines, names))
    others = [n for f in files for n in f[2]]
    parts = []
    if r.random() < 0.3:
        parts.append(f"$ find {pkg}\n" + "\n".join(sorted(f[0] for f in files)))
    for _ in range(r.randint(1, 3)):
        path, lines, names = r.choice(files)
        if r.random() < 0.7:
            parts.append(_prose(r, path, names, others))
        parts.append(f"$ {r.choice(('cat -n', 'nl -ba'))} {path}\n{numbered(lines)}" if r.random() < 0.7
                     else f"# {path}\n" + "\n".join(lines))
        for _ in range(r.choice((0, 1, 1, 1, 2))):
            edit = _edit(r, path, lines)
            if edit:
                parts.append(edit)
        if r.random() < 0.4:
            parts.append(_prose(r, path, names, others))
    return "\n\n".join(parts)


# ---- rows ----------------------------------------------------------------------------------


def copy_row(r: random.Random, ids: list[int], length: int) -> tuple[list[int], list[int]]:
    """(tokens, loss mask): a random prefix, then a random span repeated to the end; the loss
    only where the repeat is predictable (after its first period)."""
    prefix = r.randint(0, 20)
    period = r.randint(8, 60)
    span = [r.choice(ids) for _ in range(period)]
    row = [r.choice(ids) for _ in range(prefix)]
    while len(row) < length:
        row += span
    row = row[:length]
    return row, [0] * (prefix + period) + [1] * (length - prefix - period)


def doc_rows(r: random.Random, encode: Callable[[str], list[int]], eos: int, length: int) -> Iterator[list[int]]:
    """Rows of `length` tokens packed from code documents separated by end-of-text."""
    buf: list[int] = []
    while True:
        while len(buf) < length:
            buf += encode(code_doc(r)) + [eos]
        yield buf[:length]
        buf = buf[length:]


@dataclass(frozen=True)
class PretrainSpec:
    copy_steps: int = 300
    """Steps of random-token copy rows only: the copying circuit forms here."""
    mixed_steps: int = 500
    """Steps of code documents mixed with copy rows: copying carries over to software text."""
    copy_rows: int = 32
    copy_len: int = 128
    doc_rows: int = 3
    doc_len: int = 1024
    mixed_copy_rows: int = 4
    mixed_copy_len: int = 256
    lr: float = 3e-3
    norm_lr_mult: float = 10.0
    """The query/key RMSNorm weights learn this much faster (they set attention's sharpness)."""
    warmup: int = 50
    seed: int = 0


def copy_accuracy(model, ids: list[int], length: int = 256, rows: int = 16, seed: int = 12345) -> float:
    """Accuracy of predicting the repeats of a random span (tokens after its first period)."""
    import torch

    r = random.Random(seed)
    batch = [copy_row(r, ids, length) for _ in range(rows)]
    x = torch.tensor([b[0] for b in batch])
    mask = torch.tensor([b[1] for b in batch], dtype=torch.bool)
    with torch.no_grad():
        pred = model(input_ids=x).logits.argmax(-1)
    hit = (pred[:, :-1] == x[:, 1:]) & mask[:, 1:]
    return hit.sum().item() / max(1, mask[:, 1:].sum().item())


def pretrain(base: Path, out: Path, spec: PretrainSpec = PretrainSpec(), log: Callable[[str], None] = print) -> dict:
    """Pretrain the model folder `base` (service.fleet.tiny_model.init_tiny) into `out` (weights,
    tokenizer, chat template); returns its figures (also in out/pretrain.json)."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(spec.seed)
    r = random.Random(spec.seed)
    tok = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model.train()
    special = set(tok.all_special_ids) | {tok.convert_tokens_to_ids(t) for t in tok.get_added_vocab()}
    ids = [i for i in range(len(tok)) if i not in special]
    eos = tok.convert_tokens_to_ids("<|endoftext|>")

    def encode(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    norms = [p for n, p in model.named_parameters() if n.endswith(("q_norm.weight", "k_norm.weight"))]
    rest = [p for n, p in model.named_parameters() if not n.endswith(("q_norm.weight", "k_norm.weight"))]
    opt = torch.optim.AdamW([{"params": rest, "lr": spec.lr}, {"params": norms, "lr": spec.lr * spec.norm_lr_mult}],
                            lr=spec.lr, betas=(0.9, 0.95), weight_decay=0.01)
    bases = [g["lr"] for g in opt.param_groups]
    total = spec.copy_steps + spec.mixed_steps
    docs = doc_rows(r, encode, eos, spec.doc_len)
    history, started = [], time.monotonic()

    def loss_of(rows: list[list[int]], masks: list[list[int]]) -> torch.Tensor:
        x = torch.tensor(rows)
        m = torch.tensor(masks, dtype=torch.float32)[:, 1:]
        logits = model(input_ids=x).logits[:, :-1]
        nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1),
                                                reduction="none").view_as(m)
        return (nll * m).sum() / m.sum().clamp(min=1)

    for step in range(total):
        scale = min(1.0, (step + 1) / spec.warmup) * 0.5 * (1 + math.cos(math.pi * step / total))
        for g, lr in zip(opt.param_groups, bases, strict=True):
            g["lr"] = lr * max(scale, 0.05)
        if step < spec.copy_steps:
            rows = [copy_row(r, ids, spec.copy_len) for _ in range(spec.copy_rows)]
            loss = loss_of([a for a, _ in rows], [b for _, b in rows])
        else:
            rows = [copy_row(r, ids, spec.mixed_copy_len) for _ in range(spec.mixed_copy_rows)]
            text = [next(docs) for _ in range(spec.doc_rows)]
            loss = (loss_of([a for a, _ in rows], [b for _, b in rows])
                    + loss_of(text, [[1] * spec.doc_len for _ in text])) / 2
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or step == total - 1:
            model.eval()
            acc = copy_accuracy(model, ids)
            model.train()
            history.append({"step": step, "loss": round(loss.item(), 4), "copy_accuracy": round(acc, 3),
                            "s": round(time.monotonic() - started, 1)})
            log(f"pretrain step {step}/{total}: loss {loss.item():.3f}, copy accuracy {acc:.3f}, "
                f"{time.monotonic() - started:.0f} s")
    model.eval()
    figures = {"spec": asdict(spec), "history": history, "copy_accuracy": copy_accuracy(model, ids),
               "copy_accuracy_1024": copy_accuracy(model, ids, length=1024, rows=4),
               "tokens": spec.copy_steps * spec.copy_rows * spec.copy_len
               + spec.mixed_steps * (spec.mixed_copy_rows * spec.mixed_copy_len + spec.doc_rows * spec.doc_len),
               "wall_s": round(time.monotonic() - started, 1)}
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(base, out, ignore=shutil.ignore_patterns("*.safetensors", "model.safetensors.index.json"))
    model.save_pretrained(out, safe_serialization=True)
    (out / "pretrain.json").write_text(json.dumps(figures, indent=2) + "\n")
    for f in out.iterdir():
        f.chmod(f.stat().st_mode | 0o444)
    return figures


def main() -> None:
    import argparse

    from service.fleet.tiny_model import TinyModelSpec, init_tiny

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--copy-steps", type=int, default=PretrainSpec.copy_steps)
    p.add_argument("--mixed-steps", type=int, default=PretrainSpec.mixed_steps)
    a = p.parse_args()
    base = a.out.with_name(a.out.name + "-init")
    init_tiny(base, TinyModelSpec(layers=a.layers, seed=a.seed, tie_embeddings=True, qk_norm_init=0.3))
    figures = pretrain(base, a.out, PretrainSpec(copy_steps=a.copy_steps, mixed_steps=a.mixed_steps, seed=a.seed))
    print(json.dumps({k: v for k, v in figures.items() if k != "history"}))


if __name__ == "__main__":
    main()
