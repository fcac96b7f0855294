"""The tasks the training loop trains: what a batch is, its loss, an evaluation and the options
of a script. Each task is one module or one small package; it imports the run machinery
(:mod:`vitattn.training`) and the models, and nothing imports a task but its script.

    images       one image file read the way every task reads it
    classify     image classification: CIFAR-10 and the long-range task (train_cifar.py)
    detect       object detection on a COCO-format folder (examples/train_detection.py)

A new task is a module here with a class that has the loop's ``Task`` methods
(``vitattn.training.run.Task``: ``batches``, ``loss``, ``evaluate``, ``final``, ``log_line``) and a
function that builds its ``Run`` with ``vitattn.training.run.build_run``; docs/architecture.md
walks through one.
"""
