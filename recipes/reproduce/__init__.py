"""The reproduction harness of the recipes: sweeps of ``recipes/cifar.py`` and ``recipes/wmt14.py`` runs
(run plans, a runner that is safe to kill and restart, park/resume of unfinished runs across machines)
and their analysis into ``recipes/results/``.

    python recipes/reproduce --help

- :mod:`.cli`: the command line (stages train, collect, analyze, park);
- :mod:`.sweep`: the runner; :mod:`.measure`: measurements and plots shared by the analyses;
- :mod:`.small`, :mod:`.full`, :mod:`.speed`: one sweep each (``--scale cpu-small``, ``full``, ``speed``);
- ``zoo_table.py``: the convert/fold table over torchvision and timm models (a script of its own).
"""
