"""Generation: the generate worker, its decode loop and scheduler, and the model side
(runner, batch, KV slab, sampling). worker.py describes the whole design."""
