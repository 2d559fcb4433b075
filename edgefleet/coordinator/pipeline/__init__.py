"""Pipeline stages' coordinator side (issue 35): the model cut into stages, one board each, checked before any
board starts; each step's stage gradients put together for the replica.

``pipeline.stage_plan`` reads ``--pipeline BOARD,CUT@BOARD,...``; ``pipeline.piped_run`` cuts the
replica's model (``workloads.stage_cut``), checks the cut on a sample batch, and lays out where each
stage's gradient goes in the replica's vector (``coordinator.exchange.pipeline_layout``). The boards'
side is ``agent.stage_links`` and ``agent.stage_runtime``; the frames ``protocol.stage_frames``."""

__all__: list[str] = []
