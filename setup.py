from setuptools import find_packages, setup

setup(
    name="slime-rc",
    version="0.1.0",
    description="Rollout correction (truncated/masked IS, rejection sampling, veto, mismatch metrics) for RL on "
                "Megatron + SGLang",
    packages=find_packages(include=["slime_rc", "slime_rc.*", "custom_tis", "custom_tis.*"]),
    python_requires=">=3.10",
    entry_points={"console_scripts": ["slime-rc=slime_rc.cli:main"]},
    install_requires=["torch==2.13.0", "megatron-core==0.16.1", "pyyaml"],
    extras_require={
        "test": ["pytest", "hypothesis", "matplotlib"],
        "plot": ["matplotlib"],
        "gpu": ["transformer-engine", "apex", "sglang"],
    },
)
