"""The benchmarks: ``python -m rdma_device.bench SUBCOMMAND`` (``--help``
lists them; ``cli`` holds the command line and the side-by-side TensorFlow
benchmarks transfer, train and allreduce).

The other subcommands have a module each, which adds its own options
(``add_parser``): ``suite`` (with ``workloads``, ``sweep``, ``breakdown``
and its outputs, ``suite_report``), ``soak``, ``trace``, ``pybench``
(``py``, with ``pybench_plot``) and ``report`` (with ``report_tables``).
``mwms`` runs MultiWorkerMirroredStrategy clusters (allreduce, the suite,
tests); ``progress`` is the progress line on stderr.
"""
