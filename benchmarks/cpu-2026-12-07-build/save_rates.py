import torch, io, time, os, tempfile
from torch.export.pt2_archive._package import PT2ArchiveWriter
t = torch.randn(256, 1024, 1024 // 2, dtype=torch.bfloat16)  # 256 MB
n=4
ts=[t.clone() for _ in range(n)]
t0=time.perf_counter(); bufs=[]
for x in ts:
    b=io.BytesIO(); torch.save(x,b); bufs.append(b)
t1=time.perf_counter(); vals=[b.getvalue() for b in bufs]; t2=time.perf_counter()
d=tempfile.mkdtemp()
with PT2ArchiveWriter(os.path.join(d,"a.pt2")) as w:
    t3=time.perf_counter()
    for i,v in enumerate(vals): w.write_bytes(f"data/weights/w{i}", v)
    t4=time.perf_counter()
gb=n*t.numel()*2/1e9
print(f"save {gb/(t1-t0):.2f} GB/s, getvalue {gb/(t2-t1):.2f} GB/s, write {gb/(t4-t3):.2f} GB/s")
import zlib
t5=time.perf_counter(); [zlib.crc32(v) for v in vals]; t6=time.perf_counter(); print(f"zlib crc {gb/(t6-t5):.2f} GB/s")
from torch.utils.serialization import config
config.save.compute_crc32 = False
t0=time.perf_counter()
for x in ts:
    b=io.BytesIO(); torch.save(x,b)
t1=time.perf_counter(); print(f"save no-crc {gb/(t1-t0):.2f} GB/s")
with PT2ArchiveWriter(os.path.join(d,"b.pt2")) as w:
    t3=time.perf_counter()
    for i,v in enumerate(vals): w.write_bytes(f"data/weights/w{i}", v)
    t4=time.perf_counter()
print(f"write no-crc {gb/(t4-t3):.2f} GB/s")
