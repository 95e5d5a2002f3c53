"""``monokernel serve --replicas 2`` on a local Ray instance: two replicas of the bundled
SmolLM2 on the numpy backend behind Ray Serve, talked to with the real ``openai`` client.

Ray's start is slow (~20 s here, ~40 s on a loaded 2-core machine), so one module-scoped
fixture starts the command once and the assertions sit in three tests, run in file order:
requests spread over both replicas (streaming too); a replica killed mid-stream ends that
stream with an error, the other keeps serving and Ray restarts the dead one; SIGTERM stops the
command with exit 0 and leaves no process of its session running. The command runs in its own
session (start_new_session), so "nothing left" is checked by session id, and whatever is left
is killed by the fixture before it fails the test.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from helpers.serve import port_is_closed, sse_events

import httpx

# alone, after the parallel part of make test: Ray starts and restarts a replica in bounded time
pytestmark = pytest.mark.serial

pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install "
                    "'monokernel[ray]')")
openai = pytest.importorskip("openai", reason="the openai client is not installed")

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 240.0
LONG = {"prompt": "Tell me a long story.", "max_tokens": 400, "ignore_eos": True,
        "temperature": 0, "stream": True}


def session_pids(sid: int) -> list[int]:
    """Live (non-zombie) processes of session ``sid``."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
        state, session = fields[0], int(fields[3])
        if session == sid and state != "Z":
            out.append(int(d.name))
    return out


class RayServe:
    def __init__(self, proc: subprocess.Popen, port: int, log: Path):
        self.proc, self.port, self.log = proc, port, log
        self.url = f"http://127.0.0.1:{port}"
        self.returncode: int | None = None
        self.left: list[int] = []

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 90.0) -> None:
        """Signal the command, wait for it, then kill (and record) any process of its
        session still there."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self.returncode is None:
            self.returncode = self.proc.returncode
        deadline = time.monotonic() + 15  # Ray's workers exit right after the driver
        while session_pids(self.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        self.left = session_pids(self.proc.pid)
        for pid in self.left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def session_sockets(sid: int) -> list[tuple[str, str, str]]:
    """(state, local address, remote address) of every TCP socket a process of session
    ``sid`` holds, from /proc/<pid>/fd and /proc/net/tcp{,6} (addresses in the kernel's hex)."""
    inodes = set()
    for pid in session_pids(sid):
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    out = []
    for name in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/net/{name}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[9] in inodes:
                out.append((f[3], f[1].split(":")[0], f[2].split(":")[0]))
    return out


def loopback(addr: str) -> bool:
    """A /proc/net address in hex (32-bit words, each printed little-endian: 127.0.0.1 is
    0100007F): 127.0.0.0/8, ::1, or ::ffff:127.x.y.z."""
    if len(addr) == 8:
        return addr.endswith("7F")
    return addr == "0" * 24 + "01000000" or (addr[:24] == "0" * 16 + "FFFF0000"
                                             and addr.endswith("7F"))


def wildcard(addr: str) -> bool:
    return set(addr) == {"0"}


def replica_of(headers) -> tuple[str, int]:
    """(the replica's name, its pid) from the x-monokernel-replica header id@host:pid."""
    name = headers["x-monokernel-replica"]
    return name, int(name.rsplit(":", 1)[1])


@pytest.fixture(scope="module")
def ray_serve(bundled_dir, tmp_path_factory):
    from helpers.serve import free_port

    port = free_port()
    log = tmp_path_factory.mktemp("ray") / "serve.log"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO),
                                                       os.environ.get("PYTHONPATH", "")]),
               RAY_USAGE_STATS_ENABLED="0")
    with open(log, "w") as out:  # a file, not a pipe: Ray writes more than a pipe holds
        proc = subprocess.Popen(
            [sys.executable, "-m", "monokernel", "serve", "--replicas", "2", "--backend",
             "numpy", "--model", str(bundled_dir), "--port", str(port), "--log-level",
             "warning", "--drain-timeout", "2"],
            env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True)
    rs = RayServe(proc, port, log)
    t0 = time.monotonic()
    try:
        while True:
            assert proc.poll() is None, log.read_text()[-5000:]
            try:
                if httpx.get(f"{rs.url}/health", timeout=2.0).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() - t0 < START_TIMEOUT_S, log.read_text()[-5000:]
            time.sleep(0.5)
        # /health answers once one replica runs; the other may still be loading its model
        # (Ray routes only to running replicas): wait until both have answered
        names = set()
        while len(names) < 2:
            assert proc.poll() is None, log.read_text()[-5000:]
            try:
                names.add(replica_of(httpx.get(f"{rs.url}/health", timeout=10.0).headers)[0])
            except httpx.TransportError:
                pass
            assert time.monotonic() - t0 < START_TIMEOUT_S, (names, log.read_text()[-5000:])
        print(f"\nRay Serve with 2 replicas up in {time.monotonic() - t0:.1f} s")
        yield rs
    finally:
        rs.stop()


def test_the_application_builder_asks_one_gpu_per_replica_on_a_gpu_backend():
    """serve/ray_app.py's builder (a Serve config's or a KubeRay RayService's import_path):
    no cluster needed to build the application."""
    from monokernel.errors import MonokernelError
    from monokernel.serve.ray_app import build

    gpu = build({"replicas": 3, "backend": "cuda", "max_queue": 8})._bound_deployment
    assert gpu.num_replicas == 3 and gpu.ray_actor_options["num_gpus"] == 1
    assert gpu.max_ongoing_requests == 9  # the replica's queue and its running request
    cpu = build({"backend": "numpy"})._bound_deployment
    assert cpu.num_replicas == 1 and not cpu.ray_actor_options.get("num_gpus")
    with pytest.raises(MonokernelError, match="replica"):
        build({"replica": 2})
    with pytest.raises(MonokernelError, match="MONOKERNEL_API_KEY"):
        build({"api_key": "in-the-manifest"})
    with pytest.raises(MonokernelError, match="--replicas"):
        build({"replicas": 0})


def test_every_ray_process_talks_over_loopback_only(ray_serve):
    """The local Ray instance (Ray's single-node mode, set by the command), its proxy, agents
    and replicas: every TCP connection of the command's processes is between loopback
    addresses, and every listening socket is bound to loopback (or, for the replicas' own
    server, to every interface: it only accepts). Server tests talk only to 127.0.0.1; by
    default Ray binds its agents to the machine's address and connects through it."""
    httpx.get(f"{ray_serve.url}/v1/models", timeout=30.0).raise_for_status()
    sockets = session_sockets(ray_serve.proc.pid)
    listen = [(lo, rem) for st, lo, rem in sockets if st == "0A"]
    conns = [(lo, rem) for st, lo, rem in sockets if st != "0A" and not wildcard(rem)]
    assert listen and conns, sockets  # the command's processes were found
    assert all(loopback(lo) or wildcard(lo) for lo, _ in listen), listen
    assert all(loopback(lo) and loopback(rem) for lo, rem in conns), conns


def test_requests_spread_over_both_replicas(ray_serve):
    client = openai.OpenAI(base_url=f"{ray_serve.url}/v1", api_key="unused", max_retries=0,
                           timeout=120.0)
    name = client.models.list().data[0].id
    seen: list[str] = []
    texts: list[str] = []
    errors: list[BaseException] = []

    def one() -> None:
        try:
            raw = client.completions.with_raw_response.create(
                model=name, prompt="The capital of France is", max_tokens=2, temperature=0)
            seen.append(replica_of(raw.headers)[0])
            texts.append(raw.parse().choices[0].text)
        except BaseException as e:  # noqa: BLE001  (reported below)
            errors.append(e)

    threads = [threading.Thread(target=one) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert not errors, errors
    assert texts == [" Paris."] * 6  # the same engine behind both
    assert len(set(seen)) == 2, seen
    # streaming goes through Ray's proxy too
    chunks = list(client.chat.completions.create(
        model=name, stream=True, max_tokens=4, temperature=0,
        messages=[{"role": "user", "content": "What is the capital of France?"}]))
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    client.close()


def test_a_killed_replica_is_restarted_and_the_other_keeps_serving(ray_serve):
    url = ray_serve.url
    names = set()
    deadline = time.monotonic() + 60
    while len(names) < 2:  # the routing is random among idle replicas: ask until both answer
        names.add(replica_of(httpx.get(f"{url}/health", timeout=10).headers)[0])
        assert time.monotonic() < deadline, names
    with httpx.Client(base_url=url, timeout=60.0) as c:
        with c.stream("POST", "/v1/completions", json=LONG) as r:
            assert r.status_code == 200
            victim, pid = replica_of(r.headers)
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            os.kill(pid, signal.SIGKILL)
            # the proxy cuts the stream: the client sees an incomplete response, not a
            # silently short one
            with pytest.raises(httpx.RemoteProtocolError):
                sse_events(lines)
        (survivor,) = names - {victim}
        for _ in range(3):  # served at once by the other replica
            r = c.post("/v1/completions", json={"prompt": "The capital of France is",
                                                 "max_tokens": 2, "temperature": 0})
            assert r.status_code == 200, r.text
            assert replica_of(r.headers)[0] == survivor
    # Ray's controller starts a new replica in the dead one's place
    deadline = time.monotonic() + 180
    while True:
        h = httpx.get(f"{url}/health", timeout=10)
        if h.status_code == 200 and replica_of(h.headers)[0] not in names:
            break
        assert time.monotonic() < deadline, "Ray did not restart the killed replica"
        time.sleep(0.3)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_sigterm_stops_everything(ray_serve):
    ray_serve.stop(signal.SIGTERM)
    out = ray_serve.log.read_text()
    assert ray_serve.returncode == 0, out[-5000:]
    assert "server stopped" in out, out[-5000:]
    assert ray_serve.left == [], f"processes left running: {ray_serve.left}"
    assert port_is_closed(ray_serve.port)
