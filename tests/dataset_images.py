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
    from sandboxes.images import BASE_IMAGE, ensure_base_image

    ensure_base_image(client, BASE_IMAGE)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.add(str(repo), arcname=at.strip("/"), filter=lambda t: (setattr(t, "uid", 0), setattr(t, "gid", 0), t)[-1])
    box = client.containers.create(BASE_IMAGE, ["sleep", "infinity"])
    try:
        box.put_archive("/", buf.getvalue())
        repository, tag = name.rsplit(":", 1) if ":" in name.rsplit("/", 1)[-1] else (name, "latest")
        box.commit(repository=repository, tag=tag)
    finally:
        box.remove(force=True)
    return name if ":" in name.rsplit("/", 1)[-1] else f"{name}:latest"


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
