from setuptools import find_packages, setup

# Ranges, not pins: inside slime's container torch (2.11 with sglang 0.5.15) and Megatron-LM from git (registered as
# megatron-core 0.16.0rc0 at slime's commit) already satisfy them, so installing slime-rc there replaces nothing.
# No upper bounds: a cap would make pip replace a container's newer build (and its patches).  The lower bounds are
# what slime runs; the exact versions CI tests are in constraints/.  The "rc0" admits a git install of Megatron-LM,
# which reports a pre-release version.
INSTALL_REQUIRES = ["torch>=2.11", "megatron-core>=0.16.0rc0", "pyyaml"]

EXTRAS_REQUIRE = {
    "plot": ["matplotlib"],
    "tensorboard": ["tensorboard"],
    "wandb": ["wandb"],
}
EXTRAS_REQUIRE["test"] = ["pytest", "hypothesis", "matplotlib", "tensorboard", "wandb"]

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
