"""``quant=auto``: precision per layer by measured sensitivity under a budget (:mod:`~lit_ppl.quant.auto.search`),
from candidates, a sensitivity table, a knapsack and the policy it writes."""
