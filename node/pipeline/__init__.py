"""Pipeline parallelism: one stage served over P2P streams (``server``, its wire format in
``wire``), calls to a stage (``client``), and stochastic wiring of micro-batches through the
stages with retries (``trainer``: ``StageRouter``, which generation's inference passes use
too, and ``Trainer``)."""
