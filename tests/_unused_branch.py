"""Run an entry script with one more model in model.MODELS, for tests/test_ddp_errors.py. Not a product file.

    python -m torch.distributed.run --nproc_per_node=2 tests/_unused_branch.py train_multi_gpu_ddp.py \\
        model.name=unused_branch ARGS...

unused_branch: a small conv net with an auxiliary head its forward never calls, the case that
stops DDP unless ddp.find_unused_parameters=true. Registered as a user would, in MODELS.
"""
import runpy
import sys
from pathlib import Path

from torch import nn

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
import model  # noqa: E402


class UnusedBranch(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                                      nn.Flatten())
        self.fc = nn.Linear(8, num_classes)
        self.aux = nn.Linear(8, num_classes)  # never used by forward

    def forward(self, x):
        return self.fc(self.features(x))


if __name__ == "__main__":
    model.MODELS["unused_branch"] = UnusedBranch
    script, *args = sys.argv[1:]
    sys.argv = [script, *args]
    runpy.run_path(str(REPO / script), run_name="__main__")
