"""Shared test code: the one place test modules import from (no test imports another).

- ``clusters``: the ``LocalCluster`` profiles (quiet, failing) the conftest serves as fixtures;
- ``scenario``: one job, one batch per step, the failure-free reference computed once, the
  training loop with a hook before each step, and the job as a script a test can kill;
- ``faults``: a declarative fault plan (``FaultPlan().at(step=5).pause(...).then_kill()``);
- ``cli``: running ``elasticpipe`` (and ``elasticpipe admin``) as a user does;
- ``jobs``: the MLP job as a ``Pipeline`` (or ``LocalPipeline``) of given layer widths;
- ``servers``: in-process stage servers, started, registered and stopped; ``free_port``;
- ``numerics``: like-with-like references (thread counts, float32 tolerances, step checks);
- ``hf_configs``: tiny Hugging Face configs of the families the tests build;
- ``benches``: the JSON keys every bench promises;
- ``custom_models``, ``custom_losses``: user code importable by path (``--allow-models``);
- ``zb_models``: odd layers for the zero-bubble schedule;
- ``fp16_reference``: plain PyTorch fp16 training, what ``precision="fp16"`` must equal;
- ``bulk_stage``: one in-process stage holding a job, for the bulk-channel tests;
- ``prometheus``: reading a metrics endpoint;
- ``fake_cuda``: CUDA events on the host clock;
- ``multihost_client``: the client host of the multi-host test (run as a script);
- ``deploy``: the deployment files' checks;
- ``etcd``: real etcd members on loopback (the store tests);
- ``netns``: separate "hosts" (network namespaces on a bridge), and ``delay_wire``, a cable
  that holds what a host sends (this kernel has no ``netem``);
- ``replica_jobs``: the job of replicas the replica tests run, and its reference.
"""
