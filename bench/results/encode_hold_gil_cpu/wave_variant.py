import os, sys, runpy
sys.path.insert(0, "/work/main")
import art_nb.local.server.encode as enc
if os.environ.get("RELEASE") == "always":
    enc._RELEASE_GIL_CHARS = -1
if os.environ.get("SWITCH"):
    sys.setswitchinterval(float(os.environ["SWITCH"]))
sys.argv = ["bench/endpoint_wave_cpu.py", *sys.argv[1:]]
runpy.run_path("bench/endpoint_wave_cpu.py", run_name="__main__")
