"""Planning a run on paper: per-rank memory and step time of a layout, and a search over layouts.

  layout.py       Layout: the parallel sizes, ZeRO stage, recomputation, schedule, batch, precision
  state.py        params / grads / optimizer bytes per rank: parallel/bucket_plan.py, the trainer's
                  own accounting, over a description of the model's parameters (models/gpt_inventory.py)
  activations.py  what a step allocates on top: activations per schedule, loss transients, ZeRO buffers
  timing.py       roofline step time: FLOPs, collectives' bytes over links, the simulator's bubble
  hardware.py     GPU records; search.py: validity (the trainer's own rules), fit, ranking, reasons
  measure.py      StepMemory: what a real step allocates, to check the model against (tests)

megatron_lite does not import models/: the caller passes the parameter description (tools/plan.py).
"""
