import os
import sys

# Tests import small helper modules from this folder (procs, fake_unity, legacy_env);
# spawned children inherit sys.path, so they can import them too.
sys.path.insert(0, os.path.dirname(__file__))
