"""Warm spares: an engine's next process, started ahead of its need by ``pdserve up``.

Most of an engine's start is Python importing torch and the engine (seconds of CPU, many more
on a busy machine); a restart after a crash paid all of it while requests waited. A spare is
``python -m services.supervisor_spare MODULE``: it imports ``MODULE.__main__`` and waits for one
line on stdin, the JSON list of the service's flags, then runs its ``main`` with them, exactly
as ``python -m MODULE FLAGS`` would from there on (same environment, process group, parent-death
signal and pipes). ``WarmProc`` is a ``Proc`` whose restart hands its flags to its spare, if it
has a live one, instead of spawning anew. A spare whose supervisor goes sees its stdin close and
exits (or is killed by the parent-death signal first).
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import threading
from dataclasses import dataclass, field

from pdserve.procs import Proc, child_argv

ENGINE_MODULES = ("services.prefill", "services.decode", "services.engine")


@dataclass
class WarmProc(Proc):
    """A service started from its warm spare when it has one (``start_spare``)."""

    spare: subprocess.Popen[str] | None = field(default=None, repr=False)

    @property
    def module(self) -> str:
        return self.args[self.args.index("-m") + 1]

    def start_spare(self, env: dict[str, str]) -> None:
        self.spare = subprocess.Popen(
            child_argv([self.args[0], "-m", __name__, self.module], self.cpus), cwd=self.cwd,
            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, process_group=0)

    @property
    def has_spare(self) -> bool:
        return self.spare is not None and self.spare.poll() is None

    def start(self, env: dict[str, str]) -> None:
        spare, self.spare = self.spare, None
        if spare is None or not _hand_over(spare, self.args[self.args.index("-m") + 2:]):
            super().start(env)
            return
        self.log_tail = []
        self.popen = spare
        self._stderr_reader = threading.Thread(target=self._drain_stderr, daemon=True)
        self._stderr_reader.start()

    def stop_spare(self) -> None:
        if self.spare is not None and self.spare.poll() is None:
            self.spare.kill()
            self.spare.wait()
        self.spare = None


def _hand_over(spare: subprocess.Popen[str], flags: list[str]) -> bool:
    """Give ``spare`` its flags; False if it died meanwhile (then a fresh process starts)."""
    if spare.poll() is not None or spare.stdin is None:
        return False
    try:
        spare.stdin.write(json.dumps(flags) + "\n")
        spare.stdin.close()
    except OSError:
        spare.kill()
        return False
    return True


def main() -> int:
    module = sys.argv[1]
    entry = importlib.import_module(f"{module}.__main__")  # the slow part, done ahead
    line = sys.stdin.readline()
    if not line:  # the supervisor went: never needed
        return 0
    flags = json.loads(line)
    sys.argv = [module, *flags]
    result: int = entry.main(flags)
    return result


if __name__ == "__main__":
    sys.exit(main())
