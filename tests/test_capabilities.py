"""The machine's capabilities, probed once in one place (dtlab.capabilities), and
DTLAB_CPU_LACKS, which makes a machine that has a capability run the suite's other
path: the case that needs it skipped with the refusing library's own words."""

import os
import subprocess
import sys

import pytest
import torch

from dtlab import capabilities
from dtlab.capabilities import LACKS_ENV, has, lacking
from dtlab.frameworks import missing


def test_the_probes_answer_what_torch_says(monkeypatch):
    monkeypatch.delenv(LACKS_ENV, raising=False)
    assert has("fp16") == torch.ops.mkldnn._is_mkldnn_fp16_supported()
    assert has("bf16") == torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if not has("fp16"):
        assert "_is_mkldnn_fp16_supported() is False" in lacking("fp16")
    assert set(capabilities.report()) == {"fp16", "bf16", "avx512", "amx"}


def test_told_to_lack_fp16_the_probes_say_so_in_the_refusing_librarys_words(
    monkeypatch,
):
    monkeypatch.setenv(LACKS_ENV, "fp16")
    assert not has("fp16") and not has("deepspeed_fp16")
    reason = lacking("deepspeed_fp16")
    assert reason.startswith("DeepSpeed: Type fp16 is not supported on your device.")
    assert f"{LACKS_ENV}=fp16" in reason and "oneDNN's fp16 kernels" in reason
    assert lacking("bf16") == capabilities._probed("bf16")  # the rest untouched


@pytest.mark.parametrize(
    "told, name, words",
    [
        ("fp8", "fp16", "DTLAB_CPU_LACKS names fp8: the capabilities are fp16"),
        ("", "fp8", "no capability called 'fp8'"),
    ],
)
def test_unknown_names_are_refused_by_name(monkeypatch, told, name, words):
    monkeypatch.setenv(LACKS_ENV, told)
    with pytest.raises(ValueError, match=words):
        lacking(name)


def _fp16_refused(_):
    from dtlab.frameworks.deepspeed_run import train_deepspeed
    from dtlab.train import TrainConfig

    os.environ[LACKS_ENV] = "fp16"
    try:
        train_deepspeed(TrainConfig(strategy="zero2", precision="fp16", steps=1))
    except ValueError as e:
        return str(e)
    finally:
        del os.environ[LACKS_ENV]
    return "trained"


@pytest.mark.skipif(missing("deepspeed") is not None, reason=str(missing("deepspeed")))
@pytest.mark.cluster
def test_deepspeed_refuses_fp16_as_it_would_on_a_cpu_without_it(lab_cluster):
    said = lab_cluster(2).run(_fp16_refused, None, timeout=120)
    assert all(s.startswith("DeepSpeed: Type fp16 is not supported") for s in said)


@pytest.mark.skipif(missing("deepspeed") is not None, reason=str(missing("deepspeed")))
def test_the_suite_told_to_lack_fp16_skips_the_fp16_case_and_says_why():
    env = dict(os.environ, **{LACKS_ENV: "fp16"})
    test = "tests/test_frameworks.py::test_deepspeed_fp16_matches_dtlab"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-rs", "-p", "no:cacheprovider", test],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "1 skipped" in run.stdout
    assert "DeepSpeed: Type fp16 is not supported on your device." in run.stdout
    assert f"{LACKS_ENV}=fp16 (the probes answer" in run.stdout  # the run's header
