"""Installs what the step scripts need. The steps themselves are scripts, not a package:

pip install torch==2.13.0   # or the build for your CUDA; see README.md
pip install -e ".[test]"
python step3_dataloader/train.py
"""

from setuptools import setup

setup(
    name="pico3d",
    version="0.1.0",
    description="Distributed training of Llama models in fifteen steps, from one device to 5D",
    python_requires=">=3.10",
    packages=[],
    install_requires=[
        "torch>=2.5",
        "transformers>=4.45",
        "datasets>=2.20",
        "tokenizers>=0.19",
        "safetensors>=0.4",
        "wandb>=0.17",
        "numpy",
        "pyyaml",  # run files (--config)
    ],
    extras_require={
        "test": [
            "pytest>=8",
            "pytest-xdist>=3.5",
            "ruff>=0.6",
            "matplotlib",
        ],  # matplotlib: the plot tools' tests
        "plot": ["matplotlib"],
    },
)
