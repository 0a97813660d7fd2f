"""Local stand-ins for the registry images docker-compose.yml names (no registry is reachable
here): `python:3.11-slim-bookworm`, `postgres:16-bookworm` and `redis:7-bookworm`, built on the
sandboxes' debootstrap base (Debian bookworm) from Debian's own packages, with entrypoints that
honour what compose relies on (POSTGRES_USER/PASSWORD/DB and its data folder; redis-server
listening beyond loopback). Bookworm ships PostgreSQL 15 and Redis 7.0, so the PostgreSQL
stand-in is one major version behind the image it stands in for; compose takes them through
SWERVE_PYTHON_IMAGE, SWERVE_POSTGRES_IMAGE and SWERVE_REDIS_IMAGE.

`python -m tests.compose_standins` builds the three (once per engine) and prints the settings.
"""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

PYTHON = "swerve-standin/python:3.11-bookworm-dev"
POSTGRES = "swerve-standin/postgres:15-bookworm"
REDIS = "swerve-standin/redis:7-bookworm"

HOST_CA = Path("/etc/ssl/certs/ca-certificates.crt")

# The official python image has pip in a Python it owns, with its headers (torch's inductor
# compiles against them); Debian's refuses `pip install` into the system (PEP 668) and its base
# here has a uid-1000 user the app image creates itself.
PYTHON_DOCKERFILE = """\
FROM {base}
COPY ca-certificates.crt /etc/ssl/certs/ca-certificates.crt
RUN apt-get update && apt-get install -y --no-install-recommends python3-dev && rm -rf /var/lib/apt/lists/* \\
    && rm -f /usr/lib/python3*/EXTERNALLY-MANAGED && ln -sf python3 /usr/bin/python \\
    && userdel --remove sandbox
ENV LANG=C.UTF-8 PATH=/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin
CMD ["python3"]
"""

POSTGRES_DOCKERFILE = """\
FROM {base}
RUN mkdir -p /etc/postgresql-common/createcluster.d \\
    && echo "create_main_cluster = false" > /etc/postgresql-common/createcluster.d/no-main.conf \\
    && apt-get update && apt-get install -y --no-install-recommends postgresql \\
    && rm -rf /var/lib/apt/lists/* && userdel --remove sandbox \\
    && ln -s /usr/lib/postgresql/*/bin /usr/lib/postgresql/bin
ENV PATH=/usr/lib/postgresql/bin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \\
    PGDATA=/var/lib/postgresql/data LANG=C.UTF-8
COPY entrypoint.sh /usr/local/bin/docker-entrypoint.sh
ENTRYPOINT ["/usr/local/bin/docker-entrypoint.sh"]
EXPOSE 5432
CMD ["postgres"]
"""

# The official image's contract, as compose uses it: an empty data folder is initialised with
# POSTGRES_USER as superuser (password POSTGRES_PASSWORD, required), POSTGRES_DB created, and
# the server listens on every address with password authentication.
POSTGRES_ENTRYPOINT = """\
#!/bin/sh
set -eu
if [ "${1:-}" = postgres ]; then
  shift
  user="${POSTGRES_USER:-postgres}" db="${POSTGRES_DB:-${POSTGRES_USER:-postgres}}"
  mkdir -p "$PGDATA" /run/postgresql
  chown -R postgres:postgres "$PGDATA" /run/postgresql
  chmod 700 "$PGDATA"
  if [ ! -s "$PGDATA/PG_VERSION" ]; then
    : "${POSTGRES_PASSWORD:?set POSTGRES_PASSWORD}"
    pwfile=$(mktemp)
    printf '%s\\n' "$POSTGRES_PASSWORD" > "$pwfile"
    chown postgres "$pwfile"
    runuser -u postgres -- initdb -D "$PGDATA" -U "$user" --pwfile="$pwfile" \\
      --auth-local=trust --auth-host=scram-sha-256 >/dev/null
    rm -f "$pwfile"
    echo "host all all all scram-sha-256" >> "$PGDATA/pg_hba.conf"
    echo "listen_addresses = '*'" >> "$PGDATA/postgresql.conf"
    if [ "$db" != postgres ]; then
      echo "CREATE DATABASE \\"$db\\" OWNER \\"$user\\"" \\
        | runuser -u postgres -- postgres --single -D "$PGDATA" postgres >/dev/null
    fi
  fi
  exec runuser -u postgres -- postgres -D "$PGDATA" "$@"
fi
exec "$@"
"""

REDIS_DOCKERFILE = """\
FROM {base}
RUN apt-get update && apt-get install -y --no-install-recommends redis-server \\
    && rm -rf /var/lib/apt/lists/* && userdel --remove sandbox \\
    && mkdir -p /data && chown redis:redis /data
WORKDIR /data
COPY entrypoint.sh /usr/local/bin/docker-entrypoint.sh
ENTRYPOINT ["/usr/local/bin/docker-entrypoint.sh"]
EXPOSE 6379
CMD ["redis-server"]
"""

# As the official image: without a config file redis-server gets `--protected-mode no`, so the
# other containers may connect; it runs as the redis user in /data.
REDIS_ENTRYPOINT = """\
#!/bin/sh
set -eu
if [ "${1:-}" = redis-server ]; then
  shift
  chown -R redis:redis /data
  exec runuser -u redis -- redis-server --protected-mode no --bind 0.0.0.0 "$@"
fi
exec "$@"
"""


def _exists(name: str) -> bool:
    return subprocess.run(["docker", "image", "inspect", name], capture_output=True).returncode == 0


def _build(name: str, dockerfile: str, files: dict[str, bytes]) -> None:
    with tempfile.TemporaryDirectory(prefix="swerve-standin-") as tmp:
        (Path(tmp) / "Dockerfile").write_text(dockerfile)
        for file, content in files.items():
            (Path(tmp) / file).write_bytes(content)
            (Path(tmp) / file).chmod(0o755)
        done = subprocess.run(["docker", "build", "-q", "-t", name, tmp], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"building the stand-in {name} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")


def ensure_standins() -> dict[str, str]:
    """Build the stand-ins the engine lacks; return compose's settings naming them."""
    import docker

    from sandboxes.images import ensure_base_image

    base = ensure_base_image(docker.from_env())
    images = {
        PYTHON: (PYTHON_DOCKERFILE, {"ca-certificates.crt": HOST_CA.read_bytes()}),
        POSTGRES: (POSTGRES_DOCKERFILE, {"entrypoint.sh": POSTGRES_ENTRYPOINT.encode()}),
        REDIS: (REDIS_DOCKERFILE, {"entrypoint.sh": REDIS_ENTRYPOINT.encode()}),
    }
    for name, (dockerfile, files) in images.items():
        if not _exists(name):
            _build(name, dockerfile.format(base=base), files)
    return {"SWERVE_PYTHON_IMAGE": PYTHON, "SWERVE_POSTGRES_IMAGE": POSTGRES, "SWERVE_REDIS_IMAGE": REDIS}


if __name__ == "__main__":
    for key, value in ensure_standins().items():
        print(f"{key}={value}")
