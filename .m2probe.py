import time, numpy as np, pyattn
rng=np.random.default_rng(0)
B,T,H,P,N=2,4096,8,128,128
x=rng.standard_normal((B,T,H,P),dtype=np.float32)
Bm=rng.standard_normal((B,T,H,N),dtype=np.float32)*np.float32(N**-0.5)
Cm=rng.standard_normal((B,T,H,N),dtype=np.float32)*np.float32(N**-0.5)
for name, g in (("mild g",np.log(rng.uniform(0.9,1,(B,T,H)))), ("strong g",-rng.uniform(0.5,8,(B,T,H)))):
    g=g.astype(np.float32)
    for th in (1,2):
        pyattn.set_num_threads(th)
        v=[]
        for r in range(5):
            t=time.perf_counter(); pyattn.simple_gla(Cm,Bm,x,g); v.append(time.perf_counter()-t)
        v.sort(); print(name, th, "min %.1f median %.1f"%(v[0]*1e3, v[len(v)//2]*1e3), flush=True)
