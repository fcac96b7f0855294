"""The run machinery of vitattn: what trains a task, knowing nothing of CIFAR, long-range or
COCO (those are :mod:`vitattn.tasks`). One concept per module, each importing only those listed
before it:

    errors       every error a run raises for input it refuses (imports nothing of ours)
    cli          options declared once as dataclass fields; argparse, YAML defaults, exit statuses
    runtime      devices, processes (torchrun), precision, stop signals, random states and streams
    runfolder    the run folder: created, locked, resumed; files that survive a crash
    checkpoint   checkpoints written, checked and restored; final weights as safetensors
    seeds        a list of seeds (--seeds 0-3,8) and the spread of each figure over them
    stack        several seeds of a model as one (SeedStack), their random streams, their memory
    optim        optimisers by name (AdamW, SGD, Muon), parameter groups, clipping, the schedule, the EMA
    run          a run: the Task protocol, its state, its parts, build_run (fresh or from a checkpoint)
    loop         the one training loop: steps, epochs, evaluations, the end, fit
    board        TensorBoard curves
    session      a script's run start to end: options, folder, checkpoints, Ctrl-C, torchrun

``import vitattn`` does not load this package; ``import vitattn.training.loop`` (or any module) does.
"""
