"""Object detection on a COCO-format folder as a task of the training loop, with the options of
``examples/train_detection.py``.

    coco         a COCO-format folder read and checked whole; COCO box AP (pycocotools)
    task         the options, the detector, the task and detection_run
"""

from .task import (
    RESNETS,
    UNCHECKED_ON_RESUME,
    Config,
    DetectionTask,
    ResNetFPN,
    build_model,
    describe_run,
    detection_run,
    detection_task,
)

__all__ = ["RESNETS", "UNCHECKED_ON_RESUME", "Config", "DetectionTask", "ResNetFPN", "build_model", "describe_run",
           "detection_run", "detection_task"]
