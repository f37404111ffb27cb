"""`llamarl plan`: a cost model of asynchronous RL runs (plain classes, no processes).

From a model's Hugging Face config (dense, MoE, MLA), a device of the table
(devices.DEVICES), a cluster, a placement with each side's parallelism and
precision, and a batch (scenario.Scenario, read from a row in the published-runs
format), CostModel predicts generation, training, weight-sync and step time, the
memory per GPU of each side and the bottleneck; search.choose finds the placement
with the lowest predicted step that fits. The model's efficiency factors
(cost.FACTORS) are fit once per kind of device on measured runs
(calibration.fit), and leave_one_out says how far its predictions land.
local.LocalModel does the same for a `llamarl train` run on this machine's CPU
cores, its factors fit on short probe runs (`llamarl plan calibrate`,
pipeline/probes.py), and choose_local ranks that run's placements.
docs/planner.md shows a run predicted before it is bought.
"""

from .calibration import Calibration, fit, leave_one_out
from .cost import FACTORS, CostModel, Prediction
from .devices import DEVICES, Device, PlanError, device
from .local import LocalModel, LocalRun, Machine, choose_local, describe_local
from .local_calibration import LocalCalibration, fit_local
from .scenario import Batch, Scenario, Side, from_row
from .search import choose, describe
from .shapes import ModelShape, model_shape

__all__ = ["Batch", "Calibration", "CostModel", "DEVICES", "Device", "FACTORS", "LocalCalibration", "LocalModel",
           "LocalRun", "Machine", "ModelShape", "PlanError", "Prediction", "Scenario", "Side", "choose",
           "choose_local", "describe", "describe_local", "device", "fit", "fit_local", "from_row", "leave_one_out",
           "model_shape"]
