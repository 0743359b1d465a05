"""The lab: one way to run an experiment's points. A run is a `Spec` (which engine: real, simulated or
a simulated cluster; its options; the workload; tags naming the point) and `run` returns a `Record`
(servewise.metrics figures, step counts, what prefix caching, swapping and hand-offs did, wall time).
Experiments build grids of specs, report and plot the records; none keeps its own engine factory or run
loop. `ci95` gives the confidence interval of repeats over seeds; `Checkpoint` keeps each
finished point of a long grid on disk, so a stopped experiment resumes where it was."""
from servewise.lab.checkpoint import Checkpoint
from servewise.lab.record import Record
from servewise.lab.run import run, run_all
from servewise.lab.spec import Cluster, Engine, Spec
from servewise.lab.stats import ci95, mean

__all__ = ["Checkpoint", "Cluster", "Engine", "Record", "Spec", "ci95", "mean", "run", "run_all"]
