"""Process machinery shared by the engine, the DataLoader and the storage sources.

Nothing here knows about pipelines: starting children safely beside native threads
(:mod:`.forking`), children that end with their parent (:mod:`.lifetime`), arrays through
shared memory (:mod:`.shm`), ``multiprocessing`` queues without their feeder threads
(:mod:`.queues`) and a process pool fed through pipes (:mod:`.pipe_pool`, :mod:`.pipe_worker`).
The public names among them are re-exported where users meet them
(``feedline.pipeline.die_with_parent``).
"""
