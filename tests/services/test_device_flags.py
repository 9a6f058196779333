"""The engine services pass --device (and its PDSERVE_* twin), --gpu-memory-utilization and
--cuda-graphs to the engine, and refuse a CUDA device this machine lacks with one line."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from pdserve.engine.config import EngineArgs
from services.decode.config import DecodeConfig
from services.engine import instance
from services.prefill.config import PrefillConfig
from tests.e2e.stack import ROOT, child_env


def test_flags_reach_the_engine_args() -> None:
    cfg = DecodeConfig.from_argv(["--role", "colocated", "--device", "cpu",
                                  "--gpu-memory-utilization", "0.5", "--cuda-graphs", "false"],
                                 environ={})
    args = cfg.engine_args()
    assert (args.device, args.gpu_memory_utilization, args.cuda_graphs) == ("cpu", 0.5, False)


def test_env_twin_sets_the_device() -> None:
    cfg = PrefillConfig.from_argv([], environ={"PDSERVE_PREFILL_DEVICE": "cpu",
                                               "PDSERVE_PREFILL_CUDA_GRAPHS": "0"})
    assert cfg.engine_args().device == "cpu" and not cfg.engine_args().cuda_graphs


def test_the_instance_builds_its_engine_on_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[EngineArgs] = []

    def fake_from_model(model: str, args: EngineArgs) -> object:
        seen.append(args)
        raise RuntimeError("stop here")

    monkeypatch.setattr(instance.Engine, "from_model", fake_from_model)
    cfg = DecodeConfig(role="colocated", device="cpu", gpu_memory_utilization=0.25)
    with pytest.raises(RuntimeError, match="stop here"):
        instance.create_instance(cfg)
    assert (seen[0].device, seen[0].gpu_memory_utilization) == ("cpu", 0.25)


def test_gpu_memory_utilization_above_one_is_refused() -> None:
    with pytest.raises(ValueError) as err:
        DecodeConfig(role="colocated", gpu_memory_utilization=1.5)
    assert str(err.value) == "--gpu-memory-utilization must be in (0, 1], got 1.5"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
@pytest.mark.parametrize("service", ["prefill", "decode"])
def test_cuda_where_none_exists_fails_at_start_with_one_line(service: str) -> None:
    proc = subprocess.run([sys.executable, "-m", f"services.{service}", "--device", "cuda"],
                          cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    reason = (f"this torch ({torch.__version__}) is a CPU-only build; install a CUDA build of "
              "torch and the gpu extra" if torch.version.cuda is None else
              "no CUDA device is visible (check the driver and CUDA_VISIBLE_DEVICES)")
    assert proc.stderr == f"pdserve {service}: error: --device 'cuda': {reason}\n"


def test_the_decode_mirror_flag_reaches_the_engine_args(
        capsys: pytest.CaptureFixture[str]) -> None:
    def args(*argv: str) -> EngineArgs:
        return DecodeConfig.from_argv(["--role", "colocated", *argv], environ={}).engine_args()

    assert args().decode_mirror_memory_bytes is None  # as much as the KV cache
    assert args("--decode-mirror-mib", "0").decode_mirror_memory_bytes == 0
    assert args("--decode-mirror-mib", "64").decode_mirror_memory_bytes == 64 << 20
    with pytest.raises(SystemExit) as exit_:
        args("--decode-mirror-mib", "-2")
    assert exit_.value.code == 2
    assert capsys.readouterr().err == ("pdserve decode: error: --decode-mirror-mib: invalid "
                                       "value '-2' (accepted: an integer >= -1)\n")
