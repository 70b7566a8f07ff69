"""Rebuild a results JSON from a `python -m jax_mla_cache bench` log (used when the run was
cut off by its time limit before it wrote the file). Usage: log_to_json.py LOG OUT COMMIT DATE"""
import json
import re
import sys

log, out, commit, date = sys.argv[1:5]
text = open(log).read()
records = [dict(op=m[0], impl=m[1], T=int(m[2]), layers=int(m[3]), us=float(m[4]), gbps=float(m[5]))
           for m in re.findall(r"^\s+(\w+)\s+(\w+)\s+T=(\d+)\s+layers=(\d+)\s+([\d.]+) us\s+([\d.]+) GB/s",
                               text, re.M)]
head = re.search(r"bench on (.+?) \(jax ([\d.]+)\)", text)
json.dump({"device": head[1], "jax": head[2], "commit": commit, "date": date,
           "method": "device time per call from jax.profiler trace (sum of GPU kernel/memcpy events "
                     "/ calls), 10 calls; rebuilt from the log: the run hit its time limit before "
                     "move_pth and offload",
           "shapes": "DeepSeek-V3: 2^18 rows x 576, 61 layers for moves",
           "copy_gbps": float(re.search(r"copy bandwidth: ([\d.]+)", text)[1]),
           "pinned_copy_gbps": None, "records": records}, open(out, "w"), indent=1)
print(len(records), "records")
