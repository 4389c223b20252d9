"""Device run 19's diagnostic: cProfile of the decode steps (SpecEngine._step) of one glm5mtp command
run in process (PYTHONPATH=. python3 run19_cprof.py OUT.txt bench ...): the step loop's host hotspots,
by own time and cumulative (`tolist` is accept's wait for the device)."""
import cProfile, io, pstats, sys
from glm5mtp_cli.engine import speculate as S
from glm5mtp_cli.cli import main
out, argv = sys.argv[1], sys.argv[2:]
pr = cProfile.Profile()
steps = [0]
orig = S.SpecEngine._step
def step(self, active):
    steps[0] += 1
    pr.enable()
    try:
        return orig(self, active)
    finally:
        pr.disable()
S.SpecEngine._step = step
rc = main(argv)
s = io.StringIO()
s.write(f"steps {steps[0]}\n")
st = pstats.Stats(pr, stream=s)
st.sort_stats("tottime").print_stats(50)
st.sort_stats("cumulative").print_stats(50)
open(out, "w").write(s.getvalue())
