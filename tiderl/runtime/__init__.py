"""How a job is assembled and where it runs. Nothing here is imported by the packages below it
(`models`, `serving`, `train`, `envs`, `agents`, `control`); `tiderl.launch` drives it.

    job          the composition root: `run_job` wires engines, ranks, the trainer, the
                 controller and the outputs of one run, phase by phase
    build        the policy, its meshes and its first weights for a `RunConfig`
    parts        the per-mode configs and local rollout ranks both `job` and `hosts` assemble
    hosts        sites: one process or many (leader + followers) and what each one runs
    devices      the device plan (`cluster.*`): which devices serve rollout and which train,
                 JAX start-up, meshes, the compile cache
    platforms    per-platform handling (CPU, CUDA, TPU): flags, memory, colocation defaults
    cells        cells and roles: the units ERS moves between rollout and training
    elastic      moving cells inside one process at a weight-sync boundary
    worldcells   the same across processes of a JAX world
    world        the multi-process JAX world (`distributed.*`): coordinator, peers, shutdown
    localworld   a JAX world of several processes on this machine (tests, benchmarks)
    channel      the ordered message streams between processes
    wire         the plain-data form of what crosses them (handoffs, stats)
    remote_rank  rollout ranks that live on another process (`RemoteRank`, `HostAgent`)
    weightsync   moving exported weights device to device to every rollout rank
    supervise    restarting a process that was lost, once
    taskstream   the run's task stream: a grain pipeline over a task source (checkpointable)
"""
