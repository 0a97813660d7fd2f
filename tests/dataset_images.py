"""Images in the public datasets' names and layouts, built here from the base image (no registry
is reachable), and generated tasks to put in them."""

from __future__ import annotations

import io
import subprocess
import tarfile
from pathlib import Path

from envs.families import generate


def image_with_repo(client, repo: Path, name: str, at: str = "/testbed") -> str:
    """`name`: the base image with `repo` (its whole history) at `at`, owned by root, as the
    datasets' images hold their repositories."""
    return image_with(client, name, trees=[(at, repo)])


def generated_task(tmp: Path, seed: int) -> tuple[dict, Path]:
    """A generated pyfix row and its repository checked out at the base commit."""
    [row] = generate("pyfix", 1, seed, "train", tmp / "gen.jsonl", bundles_dir=tmp / "bundles")
    repo = tmp / "repo"
    subprocess.run(["git", "clone", "-q", str(tmp / "bundles" / f"{row['source'].removeprefix('bundle:')}.bundle"),
                    str(repo)], check=True)
    subprocess.run(["git", "-C", str(repo), "checkout", "-q", row["base_commit"]], check=True)
    return row, repo


def touched_tests(row: dict) -> list[str]:
    return sorted({line[6:] for line in row["test_patch"].splitlines() if line.startswith("+++ b/")})


PYTEST_DISTS = ("pytest", "_pytest", "pluggy", "iniconfig", "packaging", "pygments", "py.py")


def pytest_files(site: str) -> list[tuple[str, Path]]:
    """This interpreter's pytest and what it needs (pure Python), to put at `site` in an image:
    the datasets' images carry their own pytest and nothing here reaches a package index."""
    import _pytest

    here = Path(_pytest.__file__).resolve().parent.parent
    found = [here / n for n in PYTEST_DISTS] + sorted(here.glob("pytest-*.dist-info")) + sorted(here.glob("pluggy-*.dist-info"))
    return [(f"{site.strip('/')}/{p.name}", p) for p in found if p.exists()]


def image_with(client, name: str, trees: list[tuple[str, Path]] = (), files: dict[str, str] = {},
               links: dict[str, str] = {}) -> str:  # noqa: B006 - read only
    """`name`: the base image plus folders (`trees`, at their paths, root-owned), text files
    (executable when they start with #!) and symbolic links."""
    from sandboxes.images import BASE_IMAGE, ensure_base_image

    ensure_base_image(client, BASE_IMAGE)
    buf = io.BytesIO()
    root = (lambda t: (setattr(t, "uid", 0), setattr(t, "gid", 0), t)[-1])  # noqa: E731
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for at, path in trees:
            tar.add(str(path), arcname=at.strip("/"), filter=root)
        for at, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(at.strip("/"))
            info.size, info.mode = len(data), 0o755 if text.startswith("#!") else 0o644
            tar.addfile(info, io.BytesIO(data))
        for at, target in links.items():
            info = tarfile.TarInfo(at.strip("/"))
            info.type, info.linkname = tarfile.SYMTYPE, target
            tar.addfile(info)
    box = client.containers.create(BASE_IMAGE, ["sleep", "infinity"])
    try:
        box.put_archive("/", buf.getvalue())
        repository, tag = name.rsplit(":", 1) if ":" in name.rsplit("/", 1)[-1] else (name, "latest")
        box.commit(repository=repository, tag=tag)
    finally:
        box.remove(force=True)
    return name if ":" in name.rsplit("/", 1)[-1] else f"{name}:latest"


def git(repo: Path, *args: str, input: str | None = None) -> str:
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t",
           "HOME": str(repo), "PATH": "/usr/bin:/bin"}
    done = subprocess.run(["git", "-C", str(repo), *args], input=input, capture_output=True, text=True, env=env)
    assert done.returncode == 0, (args, done.stdout, done.stderr)
    return done.stdout


def pytest_id(unittest_name: str) -> str:
    """`test_b (tests.test_a.TestA.test_b)` as pytest names it: tests/test_a.py::TestA::test_b."""
    dotted = unittest_name.split("(", 1)[1].rstrip(")")
    module, cls, method = dotted.rsplit(".", 2)
    return f"{module.replace('.', '/')}.py::{cls}::{method}"
