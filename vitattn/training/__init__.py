"""The training half of vitattn: what ``train_cifar.py`` and ``examples/train_detection.py`` are
built from, one concept per module, each importing only those listed before it.

    errors       every error a run raises for input it refuses (imports nothing of ours)
    cli          options declared once as dataclass fields; argparse, YAML defaults, exit statuses
    runtime      devices, processes (torchrun), precision, stop signals, random states
    runfolder    the run folder: created, locked, resumed; files and checkpoints that survive a crash
    seeds        several seeds of a model as one (SeedStack), per-seed clipping, the spread over seeds
    optim        optimisers by name (AdamW, SGD, Muon), parameter groups, the lr schedule, the EMA
    data         CIFAR-style images as uint8 tensors, batches augmented on the device
    longrange    the generated long-range task
    coco         a COCO-format folder read and checked once; COCO box AP (pycocotools)
    recipes      how each model family trains by default
    loop         one training loop; a task plugs in what a batch, its loss and an evaluation are
    session      a script's run start to end: options, folder, checkpoints, Ctrl-C, torchrun
    classify     classification as a task, with the options of train_cifar.py
    detect       detection on a COCO-format folder as a task, with the options of train_detection.py
    report       a run's global-context measures, figures and report.md

``import vitattn`` does not load this package; ``import vitattn.training.loop`` (or any module) does.
"""
