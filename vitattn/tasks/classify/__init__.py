"""Image classification as a task of the training loop, with the options of ``train_cifar.py``:
CIFAR-10 or the long-range task, the ViT and the small CNN, one seed or several at once.

    options      the script's options (Config)
    recipes      how each model family trains by default
    data         CIFAR-style sources decoded once and cached; the normalisation
    batches      batches of uint8 images augmented on the device
    longrange    the generated long-range task
    setup        the data, models, teacher and memory check a run is built from
    task         the task (loss, evaluation with TTA), a group of seeds as one, classification_run
    report       the global-context measures and report.md
    plots        the run's figures
"""

from .options import Config
from .setup import (
    Dataset,
    Teacher,
    build_model,
    build_models,
    check_memory,
    context_samples,
    load_dataset,
    load_datasets,
    load_teacher,
    load_teachers,
    one_model,
    weights_file,
)
from .task import ClassifyTask, GroupTask, classification_run, classify_task, describe_run, evaluate

__all__ = ["ClassifyTask", "Config", "Dataset", "GroupTask", "Teacher", "build_model", "build_models", "check_memory",
           "classification_run", "classify_task", "context_samples", "describe_run", "evaluate", "load_dataset",
           "load_datasets", "load_teacher", "load_teachers", "one_model", "weights_file"]
