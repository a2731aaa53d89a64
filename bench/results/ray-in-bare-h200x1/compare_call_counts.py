import json, sys, glob
def load(d):
    f = glob.glob(d + "/*.json")[0]; j = json.load(open(f))
    return j["steps"], j["counts"], j["thread"]
sa, a, ta = load(sys.argv[1]); sb, b, tb = load(sys.argv[2])
print("threads:", ta, tb, "steps", sa, sb)
norm = lambda k: k.split("site-packages/")[-1] if "site-packages/" in k else k
A = {}; B = {}
for k, v in a.items(): A[norm(k)] = A.get(norm(k), 0) + v / sa
for k, v in b.items(): B[norm(k)] = B.get(norm(k), 0) + v / sb
print("total calls/step", sum(A.values()), sum(B.values()))
rows = [(B.get(k, 0) - A.get(k, 0), k, A.get(k, 0), B.get(k, 0)) for k in set(A) | set(B)]
rows.sort(key=lambda r: -abs(r[0]))
for d, k, x, y in rows[:40]:
    if abs(d) > 1e-9: print(f"{d:+9.2f} {x:9.2f} {y:9.2f} {k}")
