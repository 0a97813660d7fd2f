"""What the control plane's lease-owning supervisors share (evaluations, validations): a scan
for work whose owner stopped renewing its lease, run in the background, and on close the jobs
stopped and this process's leases given up, so that another process takes them over at once."""

from __future__ import annotations

import asyncio
import logging
import uuid

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

logger = logging.getLogger(__name__)


class LeaseSupervisor:
    """Subclasses set `engine` and `owner` and give `scan` (take over what lapsed) and `release`."""

    what = "work"
    engine: AsyncEngine
    owner: str

    def __init__(self, scan_s: float):
        self.scan_s = scan_s
        self.jobs: dict[uuid.UUID, asyncio.Task] = {}
        self._scanner: asyncio.Task | None = None

    async def scan(self) -> None:
        raise NotImplementedError

    async def release(self, conn: AsyncConnection) -> None:
        """Give up every lease `self.owner` holds."""
        raise NotImplementedError

    async def _scan_forever(self) -> None:
        while True:
            try:
                await self.scan()
            except Exception:  # a database blip: the next scan retries
                logger.exception("%s scan failed", self.what)
            await asyncio.sleep(self.scan_s)

    def run_in_background(self) -> None:
        self._scanner = asyncio.get_running_loop().create_task(self._scan_forever())

    async def close(self) -> None:
        jobs = [j for j in (self._scanner, *self.jobs.values()) if j is not None]
        for job in jobs:
            job.cancel()
        await asyncio.gather(*jobs, return_exceptions=True)
        try:
            async with self.engine.begin() as conn:
                await self.release(conn)
        except Exception:
            logger.exception("could not release the %s owned by %s", self.what, self.owner)
