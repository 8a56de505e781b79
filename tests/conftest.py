"""Test-wide settings: CPU DeepSpeed, no hub access, one distributed world per test process."""
import os
import sys
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TESTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parent
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"
sys.path.insert(0, str(TESTS_DIR))
sys.path.insert(0, str(REPO_ROOT))

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def distributed():
    """A single-process DeepSpeed world (gloo on 127.0.0.1), shared by every test in the process."""
    from utils.dist import init_distributed

    init_distributed()
    return True


@pytest.fixture
def cudnn_attention_restored():
    """cuDNN's attention kernel allowed inside the test, and torch's choice of kernels put back as the test found
    it after (`exclude_cudnn_attention` changes it for the whole process)."""
    import torch

    enabled = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(True)
    yield
    torch.backends.cuda.enable_cudnn_sdp(enabled)


@pytest.fixture
def tiny_model_dir(tmp_path):
    """Factory: `tiny_model_dir(arch)` writes a tiny HF model folder and returns its path."""
    from tiny_models import make_tiny_model_dir

    def make(arch: str = "llama", **kwargs) -> str:
        return make_tiny_model_dir(tmp_path / f"tiny-{arch}", arch, **kwargs)

    return make
