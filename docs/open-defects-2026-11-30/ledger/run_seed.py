import sys, random, tempfile, shutil
from pathlib import Path
from prop import generate, shrink, replay
seed = int(sys.argv[1])
rng = random.Random(seed)
root = Path(tempfile.mkdtemp())
ops, f, doubts = generate(rng, rng.randint(10, 40), root)
print(f)
if f:
    small = shrink(ops, f.kind)
    print(small)
    print(replay(small, verbose=True))
