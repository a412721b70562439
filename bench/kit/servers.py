"""Servers a benchmark starts as child processes (our app, vLLM's OpenAI server) and waits for."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, name: str, argv: list[str], env: dict[str, str], cwd: Path, log_path: Path, health_url: str):
        self.name, self.argv, self.health_url, self.log_path = name, argv, health_url, log_path
        self._log = log_path.open("w")
        self.proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        self.started = time.perf_counter()

    def wait_ready(self, timeout_s: float) -> float:
        """Seconds until the health URL answered 200; raises if the process died or time ran out."""
        deadline = self.started + timeout_s
        with httpx.Client(timeout=5) as client:
            while time.perf_counter() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.name} exited with {self.proc.returncode} before it was ready "
                                       f"(log: {self.log_path})\n{self.tail()}")
                try:
                    if client.get(self.health_url).status_code == 200:
                        return time.perf_counter() - self.started
                except httpx.TransportError:
                    pass
                time.sleep(1.0)
        raise TimeoutError(f"{self.name} not ready after {timeout_s:.0f} s (log: {self.log_path})\n{self.tail()}")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, lines: int = 25) -> str:
        self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def error_lines(self, limit: int = 30) -> list[str]:
        """The first lines that name an error: the root cause, before the cascade it sets off."""
        self._log.flush()
        lines = self.log_path.read_text(errors="replace").splitlines()
        return [line[:400] for line in lines if "Error" in line and "EngineDeadError" not in line][:limit]

    def stop(self, grace_s: float = 60.0) -> None:
        for sig, wait_s in ((signal.SIGINT, grace_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(wait_s)
            except subprocess.TimeoutExpired:
                continue
            # The leader is gone; anything it left in its group goes too.
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            break
        self._log.close()
