"""Several sandboxes behind one `Sandbox` client: `BalancedSandbox` (the balancing and retry), and
`SandboxFleet` over `posttrain sandbox serve` services (`RaySandboxPool` in `ray_pool` is the other kind).

Jobs go to the node with the fewest jobs in flight (ties: the one used least recently). A node that
cannot be reached or does not answer is taken out of rotation for `cooldown_s` and must pass a health
check (a service's `GET /health`) before it gets jobs again; the jobs it lost are sent to another node.
A job only becomes `SANDBOX_ERROR` (an infrastructure failure, never a score) when every node has
failed it or none is reachable. A job is safe to run twice: jobs are isolated and return their result,
so retrying one whose node died mid-run changes nothing but the time it takes.

A request a service refuses (bad token, a job over the limits, a malformed job) raises
`RemoteSandboxError` as `RemoteSandbox` does: another service would refuse it too.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from posttrain.sandbox.api import ExecResult, ExecStatus, Job
from posttrain.sandbox.remote import RemoteSandbox


class NodeClient(Protocol):
    """One node of a `BalancedSandbox`: `try_batch` gives (results, "") or (None, why) when the node
    failed (nothing is known about the jobs then); `health` raises when the node is not usable."""

    @property
    def name(self) -> str: ...

    async def try_batch(self, jobs: Sequence[Job]) -> tuple[list[ExecResult] | None, str]: ...

    async def health(self, timeout_s: float | None = None) -> dict: ...

    async def close(self) -> None: ...


@dataclass
class _Node:
    client: NodeClient
    in_flight: int = 0
    last_used: float = 0.0
    down_until: float = 0.0  # monotonic time; 0: in rotation
    failures: int = 0
    jobs: int = 0
    last_error: str = ""
    probe: asyncio.Task | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return self.client.name


def parse_urls(spec: str | Sequence[str]) -> list[str]:
    """`http://a:1,http://b:2` (or a list) -> the URLs, checked: each is http(s)://host:port, none twice."""
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    urls = [u.strip().rstrip("/") for u in items if u.strip()]
    if not urls:
        raise ValueError("no sandbox service URL given")
    for url in urls:
        if not url.startswith(("http://", "https://")) or "://" not in url or not url.split("://", 1)[1]:
            raise ValueError(f"sandbox service URL {url!r} is not http(s)://host:port")
    dupes = sorted({u for u in urls if urls.count(u) > 1})
    if dupes:
        raise ValueError(f"sandbox service URL listed twice: {', '.join(dupes)}")
    return urls


class BalancedSandbox:
    """`Sandbox` over several nodes, with load balancing, health checks and retry elsewhere (see the
    module docstring). `what` names a node in the error of a job no node could run."""

    what = "sandbox node"

    def __init__(self, clients: Sequence[NodeClient], cooldown_s: float, health_timeout_s: float) -> None:
        if cooldown_s <= 0 or health_timeout_s <= 0:
            raise ValueError("cooldown_s and health_timeout_s must be > 0")
        self.nodes = [_Node(c) for c in clients]
        self.cooldown_s = cooldown_s
        self.health_timeout_s = health_timeout_s
        self.stats = {"jobs": 0, "retried": 0, "sandbox_errors": 0, "node_failures": 0}

    # -- rotation --------------------------------------------------------------------------------------

    def _mark_down(self, node: _Node, why: str) -> None:
        node.failures += 1
        node.last_error = why
        node.down_until = time.monotonic() + self.cooldown_s
        self.stats["node_failures"] += 1

    async def _check(self, node: _Node) -> bool:
        """A health check for a node whose cooldown is over: back in rotation, or down for another one."""
        try:
            await node.client.health(timeout_s=self.health_timeout_s)
        except Exception as err:  # any failure (refused, unreachable, timed out) keeps it out
            self._mark_down(node, f"health check failed: {type(err).__name__}: {err}")
            return False
        node.down_until = 0.0
        return True

    async def _usable(self, exclude: set[int]) -> list[int]:
        """Indices of nodes in rotation and not in `exclude`; nodes past their cooldown are checked first
        (concurrently, one probe per node however many callers ask)."""
        now = time.monotonic()
        due = [i for i, n in enumerate(self.nodes) if i not in exclude and 0 < n.down_until <= now]
        for i in due:
            node = self.nodes[i]
            if node.probe is None or node.probe.done():
                node.probe = asyncio.ensure_future(self._check(node))
        if due:
            await asyncio.gather(*(self.nodes[i].probe for i in due), return_exceptions=True)
        return [i for i, n in enumerate(self.nodes) if i not in exclude and n.down_until == 0.0]

    # -- Sandbox interface -------------------------------------------------------------------------------

    async def run(self, job: Job) -> ExecResult:
        return (await self.run_batch([job]))[0]

    async def run_batch(self, jobs: Sequence[Job]) -> list[ExecResult]:
        results: list[ExecResult | None] = [None] * len(jobs)
        tried: list[set[int]] = [set() for _ in jobs]
        errors: list[list[str]] = [[] for _ in jobs]
        pending = list(range(len(jobs)))
        self.stats["jobs"] += len(jobs)
        first = True
        while pending:
            if not first:
                self.stats["retried"] += len(pending)
            first = False
            groups: dict[int, list[int]] = {}
            load = {i: n.in_flight for i, n in enumerate(self.nodes)}
            for idx in pending:
                usable = await self._usable(tried[idx])
                if not usable:
                    results[idx] = self._failed(tried[idx], errors[idx])
                    continue
                pick = min(usable, key=lambda j: (load[j], self.nodes[j].last_used))
                load[pick] += 1
                groups.setdefault(pick, []).append(idx)
            outcomes = await asyncio.gather(
                *(self._send(i, [jobs[k] for k in ks]) for i, ks in groups.items())
            )
            pending = []
            for (node_idx, ks), (got, why) in zip(groups.items(), outcomes, strict=True):
                for pos, k in enumerate(ks):
                    res = None if got is None else got[pos]
                    if res is None:
                        tried[k].add(node_idx)
                        errors[k].append(f"{self.nodes[node_idx].name}: {why}")
                        pending.append(k)
                    else:
                        results[k] = res
        done = [r for r in results if r is not None]
        assert len(done) == len(jobs)
        return done

    def _failed(self, tried: set[int], errors: list[str]) -> ExecResult:
        """The infrastructure failure of a job no node could run, with every node's reason."""
        reasons = list(errors) + [
            f"{n.name}: out of rotation ({n.last_error or 'down'})"
            for i, n in enumerate(self.nodes)
            if i not in tried
        ]
        self.stats["sandbox_errors"] += 1
        return ExecResult(
            status=ExecStatus.SANDBOX_ERROR,
            error=f"no {self.what} could run this job ({len(tried)} of {len(self.nodes)} tried, "
            f"the rest out of rotation): " + "; ".join(reasons),
        )

    async def _send(self, node_idx: int, batch: list[Job]) -> tuple[list[ExecResult] | None, str]:
        node = self.nodes[node_idx]
        node.in_flight += len(batch)
        node.last_used = time.monotonic()
        try:
            got, why = await node.client.try_batch(batch)
        finally:
            node.in_flight -= len(batch)
        if got is None:
            self._mark_down(node, why)
        else:
            node.jobs += len(batch)
        return got, why

    async def health(self) -> dict:
        """Each node's health (or its error), and the counters."""

        async def one(node: _Node) -> dict:
            try:
                return {
                    "name": node.name,
                    "ok": True,
                    **await node.client.health(timeout_s=self.health_timeout_s),
                }
            except Exception as err:  # reported, not raised: one node down is what this shows
                return {"name": node.name, "ok": False, "error": f"{type(err).__name__}: {err}"}

        nodes = await asyncio.gather(*(one(n) for n in self.nodes))
        for entry, node in zip(nodes, self.nodes, strict=True):
            entry.update(jobs=node.jobs, failures=node.failures, in_rotation=node.down_until == 0.0)
        return {"ok": any(n["ok"] for n in nodes), "nodes": list(nodes), "stats": dict(self.stats)}

    async def close(self) -> None:
        for node in self.nodes:
            if node.probe is not None and not node.probe.done():
                node.probe.cancel()
            await node.client.close()

    async def __aenter__(self) -> BalancedSandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class SandboxFleet(BalancedSandbox):
    """`BalancedSandbox` over `posttrain sandbox serve` services, one `RemoteSandbox` client each."""

    what = "sandbox service"

    def __init__(
        self,
        urls: str | Sequence[str],
        token: str | None,
        timeout_s: float = 600.0,
        cooldown_s: float = 5.0,
        health_timeout_s: float = 2.0,
    ) -> None:
        clients = [RemoteSandbox(u, token, timeout_s=timeout_s) for u in parse_urls(urls)]
        super().__init__(clients, cooldown_s, health_timeout_s)
