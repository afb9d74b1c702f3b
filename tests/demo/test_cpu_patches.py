"""``apply_cpu_patches`` harms nothing: tensors made in a ``torch.device`` context, or by a transformers model loaded
after the patches, are the same as without them; nothing is patched when CUDA is present.  And the main job on a
machine without TE/Apex says so in one line, not megatron-core's wall of warnings.

The patches are process-global, so every check runs in fresh subprocesses: one without the patches (the reference)
and one that applies them first -- before anything has used a device context, which is what exposed PyTorch's cached
set of factory functions (filled after the patches it held our wrappers, and ``with torch.device("meta")`` then put
``torch.tensor`` & co. on the CPU).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

import torch

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU patches apply only without a GPU")

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(body: str, patch: bool, *argv: str) -> dict:
    """Run ``body`` (which sets ``out``, a JSON-able dict) in a fresh interpreter, after ``apply_cpu_patches()`` when
    ``patch``; return ``out``."""
    prelude = "import json, sys, warnings\nwarnings.simplefilter('ignore')\nimport torch\n"
    if patch:
        prelude += "from slime_rc.demo.cpu_patches import apply_cpu_patches\nassert apply_cpu_patches()\n"
    code = prelude + textwrap.dedent(body) + "\nprint('@@' + json.dumps(out))\n"
    env = dict(os.environ, PYTHONPATH=_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), TORCHDYNAMO_DISABLE="1")
    proc = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, env=env, cwd=_ROOT,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("@@")][-1]
    return json.loads(line[2:])


_DEVICE_CONTEXT = """
def made(dev):
    with torch.device(dev):
        ts = {"tensor": torch.tensor([1.5, -2.0]), "arange": torch.arange(4, dtype=torch.float32),
              "zeros": torch.zeros(2, 3), "ones": torch.ones(3), "empty": torch.empty(2), "full": torch.full((2,), 7.0),
              "linspace": torch.linspace(0, 1, 5)}
    return {k: [t.device.type, list(t.shape), str(t.dtype), None if t.is_meta or k == "empty" else t.tolist()]
            for k, t in ts.items()}

torch.set_default_device("meta")
default_meta = torch.tensor([1.0]).device.type
torch.set_default_device(None)
out = {"meta": made("meta"), "cpu": made("cpu"), "default_meta": default_meta}
"""


def test_device_context_after_patches_makes_the_same_tensors():
    before = _run(_DEVICE_CONTEXT, patch=False)
    after = _run(_DEVICE_CONTEXT, patch=True)
    assert before["meta"]["tensor"][0] == "meta" and before["default_meta"] == "meta"
    assert after == before


_CUDA_PRESENT = """
torch.cuda.is_available = lambda: True
from slime_rc.demo.cpu_patches import apply_cpu_patches, cpu_patches_applied
factory = torch.tensor
current_device = torch.cuda.current_device
applied = apply_cpu_patches()
out = {"applied": applied, "flag": cpu_patches_applied(), "same": torch.tensor is factory
       and torch.cuda.current_device is current_device}
"""


def test_nothing_is_patched_when_cuda_is_available():
    assert _run(_CUDA_PRESENT, patch=False) == {"applied": False, "flag": False, "same": True}


_SAVE_TINY_LLAMA = """
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, rope_theta=10000.0)
model = LlamaForCausalLM(cfg)
model.save_pretrained(sys.argv[1])
out = {}
"""

_LOAD_TINY_LLAMA = """
from transformers import LlamaForCausalLM
model = LlamaForCausalLM.from_pretrained(sys.argv[1])
model.eval()
buffers = {k: v.tolist() for k, v in model.named_buffers() if "inv_freq" in k}
params = {k: float(v.double().sum()) for k, v in model.state_dict().items()}
with torch.no_grad():
    logits = model(torch.arange(8).unsqueeze(0)).logits
out = {"buffers": buffers, "params": params, "logits": logits.flatten()[:64].tolist()}
"""


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed")
def test_transformers_model_loaded_after_patches_is_the_same(tmp_path):
    _run(_SAVE_TINY_LLAMA, False, str(tmp_path))
    before = _run(_LOAD_TINY_LLAMA, False, str(tmp_path))
    after = _run(_LOAD_TINY_LLAMA, True, str(tmp_path))
    assert before["buffers"], "no rotary inv_freq buffer found"
    assert after["buffers"] == before["buffers"]  # garbage ([-1.17e13, 4.6e-41, ...]) without the fix
    assert after["params"] == before["params"]
    assert after["logits"] == pytest.approx(before["logits"], abs=1e-6)


def test_main_job_says_the_megatron_fallbacks_in_one_line(tmp_path):
    """megatron-core 0.16-0.19 warn 6 times (12 stderr lines) on import about missing TE/Apex; the demo filters
    exactly those and prints one line."""
    from slime_rc.demo.model import megatron_fallbacks_line

    env = dict(os.environ, PYTHONPATH=_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), PYTHONWARNINGS="")
    proc = subprocess.run([sys.executable, "-m", "slime_rc", "train", "--use-tis", "--num-steps", "1",
                           "--output-dir", str(tmp_path / "run")], capture_output=True, text=True, env=env,
                          cwd=_ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    said = [ln for ln in proc.stderr.splitlines() if re.search(r"Transformer Engine|\bApex\b", ln)]
    line = megatron_fallbacks_line()
    assert said == ([line] if line else []), proc.stderr
