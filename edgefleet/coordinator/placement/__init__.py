"""Layer placement's coordinator side: the tail of a cut model trains here, over the whole global batch.

``placement.placed_run`` checks the cut before any board starts and maps each step's gradients into
the replica's vector; ``placement.tail_server`` is the tail host's endpoint (two activation rounds
per step, before the gradient exchange's round for the head); ``placement.tail_host`` is the tail's
arithmetic (forward and backward over the boards' slices, weighted as ``Trainer.fit``'s loss is).
The cut itself is ``workloads.layer_cut``, the board's side ``agent.remote_tail``, the frames
``protocol.activation_frames``."""

__all__: list[str] = []
