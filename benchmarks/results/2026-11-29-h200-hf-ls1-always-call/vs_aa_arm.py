"""gpulens arm against the A/A arm (hf_ls1_b) and against the mean of both baselines, per round, pooled.

An exploration after seeing the data: mean +- 2.01 standard errors (t at 47 degrees of freedom;
a little wide for more rounds). Usage: python3 vs_aa_arm.py c*/g0/r*/paths_aa.json
"""
import json,sys,statistics as st
d=[]
for f in sys.argv[1:]:
    p=json.load(open(f))['paths']['hf_ls1']['arms']
    g=p['hf_ls1_gpulens']['per_round_ms'];b=p['hf_ls1_b']['per_round_ms'];a=p['hf_ls1']['per_round_ms']
    for r in g:
        base=(a[r]+b[r])/2
        d.append((100*(g[r]-b[r])/b[r], 100*(g[r]-base)/base))
for i,name in enumerate(['gpulens - A/A arm','gpulens - mean of both baselines']):
    x=[t[i] for t in d];m=st.mean(x);se=st.stdev(x)/len(x)**.5
    print(f"{name}: {m:+.3f} [{m-2.01*se:+.3f}, {m+2.01*se:+.3f}] pp, n={len(x)}")
