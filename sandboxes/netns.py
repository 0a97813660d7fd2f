"""Outbound network for bubblewrap sandboxes that ask for it, never the host's own network.

The sandbox keeps its own network namespace; slirp4netns gives it a user-mode link to the
outside (host loopback disabled), and packet-filter rules inside that namespace reject traffic
to the host's addresses, loopback, link-local (cloud metadata) and private ranges before it
reaches slirp4netns. `SWERVE_SANDBOX_NET_ALLOW` (comma-separated CIDRs) lets a deployment
reach, say, a package mirror on a private address.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import os
import socket
import subprocess

SLIRP_DNS = "10.0.2.3"  # slirp4netns's DNS forwarder inside the namespace
# Never reachable: "this network", private, carrier-grade NAT, loopback, link-local (metadata
# services), IETF protocol assignments, benchmarking, multicast and reserved.
BLOCKED = ("0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16",
           "172.16.0.0/12", "192.0.0.0/24", "192.168.0.0/16", "198.18.0.0/15", "224.0.0.0/4",
           "240.0.0.0/4")  # fmt: skip


class NetworkError(Exception):
    """The sandbox's network could not be set up; nothing of it is left running."""


def allowed() -> list[str]:
    """CIDRs from SWERVE_SANDBOX_NET_ALLOW. Raises NetworkError naming a bad entry."""
    out = []
    for item in filter(None, (s.strip() for s in os.environ.get("SWERVE_SANDBOX_NET_ALLOW", "").split(","))):
        try:
            out.append(str(ipaddress.ip_network(item, strict=False)))
        except ValueError as e:
            raise NetworkError(f"SWERVE_SANDBOX_NET_ALLOW: {item!r} is not a CIDR ({e}); "
                               "write e.g. 10.1.2.3/32,10.8.0.0/16") from e
    return out


def host_addresses() -> list[str]:
    """Every IPv4 address of this host's interfaces (a public one is no private range)."""
    done = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True)
    addrs = {line.split()[3].split("/")[0] for line in done.stdout.splitlines() if len(line.split()) > 3}
    with contextlib.suppress(OSError):
        addrs.update(info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET))
    return sorted(addrs)


def resolvers() -> list[str]:
    """The host's IPv4 DNS servers (/etc/resolv.conf), loopback ones left out."""
    try:
        lines = open("/etc/resolv.conf").read().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        parts = line.split()
        if len(parts) >= 2 and parts[0] == "nameserver":
            with contextlib.suppress(ValueError):
                addr = ipaddress.ip_address(parts[1])
                if addr.version == 4 and not addr.is_loopback:
                    found.append(str(addr))
    return found


def rules() -> str:
    """iptables-restore input for the sandbox's namespace: DNS to slirp, then the drops."""
    lines = ["*filter", ":INPUT ACCEPT [0:0]", ":FORWARD DROP [0:0]", ":OUTPUT ACCEPT [0:0]",
             "-A OUTPUT -o lo -j ACCEPT"]
    for proto in ("udp", "tcp"):
        lines.append(f"-A OUTPUT -d {SLIRP_DNS}/32 -p {proto} --dport 53 -j ACCEPT")
    lines += [f"-A OUTPUT -d {cidr} -j ACCEPT" for cidr in allowed()]
    for cidr in (*BLOCKED, *(f"{a}/32" for a in host_addresses())):
        lines.append(f"-A OUTPUT -d {cidr} -j REJECT --reject-with icmp-admin-prohibited")
    return "\n".join([*lines, "COMMIT", ""])


class UserNet:
    """slirp4netns attached to a sandbox's namespace; `close` stops it (so does our death)."""

    def __init__(self, proc: asyncio.subprocess.Process, exit_w: int):
        self.proc, self._exit_w = proc, exit_w

    @classmethod
    async def attach(cls, pid: int) -> UserNet:
        """Filter, then link, the network namespace of `pid`. Raises NetworkError."""
        netns = f"/proc/{pid}/ns/net"
        done = await asyncio.create_subprocess_exec(
            "nsenter", f"--net={netns}", "iptables-restore", stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        out, _ = await done.communicate(rules().encode())
        if done.returncode != 0:
            raise NetworkError(f"cannot filter the sandbox's network: {out.decode(errors='replace')[-1000:]}")
        ready_r, ready_w = os.pipe()
        exit_r, exit_w = os.pipe()
        try:
            proc = await asyncio.create_subprocess_exec(
                "slirp4netns", "--netns-type=path", "--configure", "--mtu=65520", "--disable-host-loopback",
                f"--ready-fd={ready_w}", f"--exit-fd={exit_r}", netns, "tap0",
                pass_fds=(ready_w, exit_r), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        except OSError as e:
            os.close(exit_w)
            raise NetworkError(f"cannot start slirp4netns: {e}") from e
        finally:
            os.close(ready_w)
            os.close(exit_r)
        net = cls(proc, exit_w)
        try:
            ready = await asyncio.wait_for(asyncio.to_thread(os.read, ready_r, 1), 10)
        except TimeoutError:
            ready = b""
        finally:
            os.close(ready_r)
        if ready != b"1":
            await net.close()
            err = await proc.stderr.read()
            raise NetworkError(f"slirp4netns did not come up: {err.decode(errors='replace')[-1000:]}")
        return net

    async def close(self) -> None:
        if self._exit_w >= 0:
            os.close(self._exit_w)
            self._exit_w = -1
        if self.proc.returncode is None:
            try:
                await asyncio.wait_for(self.proc.wait(), 2)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()


async def read_child_pid(fd: int, timeout_s: float = 30.0) -> int:
    """bubblewrap's --info-fd JSON: the pid of the sandbox's first process."""

    def read() -> int:
        data = b""
        while b"}" not in data:
            chunk = os.read(fd, 4096)
            if not chunk:
                raise NetworkError(f"bubblewrap exited before reporting its sandbox: {data!r}")
            data += chunk
        return int(json.loads(data[: data.index(b"}") + 1])["child-pid"])

    return await asyncio.wait_for(asyncio.to_thread(read), timeout_s)


DOCKER_NETWORK = "swerve-egress"
DOCKER_BRIDGE = "swerve0"


def docker_egress_network(client) -> str:
    """The Docker network for sandboxes with network on: its own bridge, no traffic between
    containers, and rules on this host rejecting anything it sends to the host itself or to the
    blocked ranges. Raises NetworkError when the engine is not on this host (its rules would not
    apply there)."""
    import docker

    if not client.api.base_url.startswith(("http+docker://localhost", "http+docker://localunixsocket")):
        raise NetworkError(f"the Docker engine at {client.api.base_url} is not on this host: swerve cannot "
                           "filter its sandboxes' network; run sandboxes with network off there")
    try:
        client.networks.get(DOCKER_NETWORK)
    except docker.errors.NotFound:
        client.networks.create(DOCKER_NETWORK, driver="bridge", labels={"swerve.egress": "1"}, options={
            "com.docker.network.bridge.name": DOCKER_BRIDGE, "com.docker.network.bridge.enable_icc": "false"})
    reject = ["-j", "REJECT", "--reject-with", "icmp-admin-prohibited"]
    rules = [["INPUT", "-i", DOCKER_BRIDGE, *reject]]  # the host itself, on any of its addresses
    rules += [["FORWARD", "-i", DOCKER_BRIDGE, "-d", cidr, "-j", "ACCEPT"] for cidr in allowed()]
    # Docker's resolver forwards from inside the container's namespace to the host's resolvers
    rules += [["FORWARD", "-i", DOCKER_BRIDGE, "-d", f"{ns}/32", "-p", proto, "--dport", "53", "-j", "ACCEPT"]
              for ns in resolvers() for proto in ("udp", "tcp")]
    rules += [["FORWARD", "-i", DOCKER_BRIDGE, "-d", cidr, *reject] for cidr in BLOCKED]
    for rule in reversed(rules):  # each insert goes first: the list ends up in this order
        if subprocess.run(["iptables", "-w", "-C", *rule], capture_output=True).returncode != 0:
            done = subprocess.run(["iptables", "-w", "-I", *rule], capture_output=True, text=True)
            if done.returncode != 0:
                raise NetworkError(f"cannot add the rule {' '.join(rule)}: {done.stderr.strip()}")
    return DOCKER_NETWORK
