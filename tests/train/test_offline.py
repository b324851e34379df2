"""batchfit is offline: building a language model reaches for no network, imports
bitsandbytes only for 4-bit weights, and prints no third party's warning first
(train/language/quantize.py, train/language/hf.py).

bitsandbytes' CPU backend, imported on a CPU with AVX512-BF16, asks the kernels package for
a kernel on the Hugging Face Hub; offline, that ends in its warning "Failed to load CPU
gemm_4bit_forward from kernels-community: Kernel repository ... could not verify publisher
trust status", the first line of every language-model report. Each test runs in a fresh
process (imports are what is tested) that emulates such a CPU whatever this one is, and
blocks and records every connection and name lookup: before the fix each of these saw
the lookup of huggingface.co and the warning."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")

REPO = Path(__file__).resolve().parents[2]

# Run first in the child: bitsandbytes sees a CPU with AVX512-BF16 (its
# `has_avx512bf16`, read by its CPU backend as it is imported), and every name lookup or
# connection is recorded and refused.
PRELUDE = """
import builtins, json, socket, sys
attempts = []
def _refused(*args, **kwargs):
    attempts.append(repr(args[:2])[:200])
    raise OSError("network refused by tests/train/test_offline.py")
socket.getaddrinfo = _refused
socket.socket.connect = lambda self, *args: _refused(*args)
socket.socket.connect_ex = lambda self, *args: _refused(*args)
_import = builtins.__import__
def _avx512bf16(name, globals=None, locals=None, fromlist=(), level=0):
    module = _import(name, globals, locals, fromlist, level)
    if name == "bitsandbytes.functional" and "has_avx512bf16" in (fromlist or ()):
        module.has_avx512bf16 = lambda: True
    return module
builtins.__import__ = _avx512bf16
"""

BUILD = """
from batchfit.train.language.hf import causal_lm
model = causal_lm(config="llama3_tiny", lora={"r": 4}, vocab_size=256, block_size=64,
                  quantization=sys.argv[1])
q_proj = model.base_model.model.model.layers[0].self_attn.q_proj
print("RESULT", json.dumps({"attempts": attempts,
                            "bitsandbytes": sys.modules.get("bitsandbytes") is not None,
                            "layer": type(q_proj).__module__}))
"""

REPORT = """
import runpy
sys.argv = ["search.fit", *sys.argv[1:]]
try:
    runpy.run_module("search.fit", run_name="__main__")
finally:
    print("RESULT", json.dumps({"attempts": attempts,
                                "bitsandbytes": sys.modules.get("bitsandbytes") is not None}))
"""

HUB = ("kernels-community", "gemm_4bit_forward", "publisher trust", "huggingface.co")


def _run(code: str, *args: str, timeout: int) -> tuple[dict, str]:
    """The child's last result and all else it printed (stdout and stderr)."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "PYTHONWARNINGS")}
    done = subprocess.run(
        [sys.executable, "-c", PRELUDE + code, *args], cwd=REPO, env=env,
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    printed = done.stdout + done.stderr
    assert done.returncode == 0, printed[-4000:]
    lines = printed.splitlines()
    result = [line for line in lines if line.startswith("RESULT ")][-1]
    rest = "\n".join(line for line in lines if not line.startswith("RESULT "))
    return json.loads(result.removeprefix("RESULT ")), rest


@pytest.mark.parametrize(
    ("quantization", "layer"), [("none", "peft.tuners.lora.layer"), ("nf4", "peft.tuners.lora.bnb")]
)
def test_a_language_model_builds_without_the_network(quantization, layer):
    """LoRA: bitsandbytes is not imported at all (peft imports it wherever it is installed).
    QLoRA: it is, without the Hub lookup and without its warning, and its 4-bit layers
    still get peft's 4-bit LoRA layers (the module of the adapted q_proj's class)."""
    result, printed = _run(BUILD, quantization, timeout=600)
    assert result["attempts"] == []
    assert result["bitsandbytes"] == (quantization != "none")
    assert result["layer"] == layer
    for text in HUB:
        assert text not in printed


def test_a_lora_build_then_a_qlora_build_in_one_process():
    """A study searching model.quantization builds both in one process: the 4-bit one after
    a build that kept bitsandbytes out still gets peft's 4-bit LoRA layers."""
    code = BUILD.replace("quantization=sys.argv[1])", "quantization='none')") + BUILD
    result, printed = _run(code, "nf4", timeout=600)
    assert result["attempts"] == [] and result["bitsandbytes"]
    assert result["layer"] == "peft.tuners.lora.bnb"
    for text in HUB:
        assert text not in printed


@pytest.mark.slow
def test_the_qlora_fit_report_starts_with_its_own_first_line():
    """`python -m search.fit +experiment=llm_qlora` (one cell a table, to stay short): no
    network, no Hub kernel, and the first line printed is the report's."""
    space = (
        '++search.params={trainer.batch_size:"choice(1)",trainer.accum_steps:"choice(1)",'
        'trainer.precision:"choice(fp32)",data.seq_len:"choice(64)",'
        'trainer.activation_checkpointing:"choice(none)",model.quantization:"choice(nf4)"}'
    )
    result, printed = _run(REPORT, "+experiment=llm_qlora", space, timeout=900)
    assert result["attempts"] == [] and result["bitsandbytes"]
    for text in HUB:
        assert text not in printed
    first = next(line for line in printed.splitlines() if line.strip())
    assert "Fit report for" in first, printed[:2000]
