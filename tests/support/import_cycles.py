"""An import-linter contract: no module reaches itself through its own imports.

`acyclic_siblings` only compares siblings, so a package's `__init__` that imports
a child which imports the package back (even inside a function: import-linter
reads every `import` statement) slips through.  This contract walks grimp's
graph of single modules instead, so any such loop fails `lint-imports`.
"""

from __future__ import annotations

import grimp
from importlinter.application import contract_utils
from importlinter.application.contract_utils import AlertLevel
from importlinter.domain import fields
from importlinter.domain.contract import Contract, ContractCheck


class ModuleCyclesContract(Contract):
    """Fails when a chain of imports leads from a module back to itself."""

    type_name = "module_cycles"

    root = fields.StringField()
    ignore_imports = fields.SetField(subfield=fields.ImportExpressionField(), required=False)
    """Imports grimp misreads (none today: the C extensions are loaded by their full
    names, so no import goes through a package's facade)."""

    def check(self, graph: grimp.ImportGraph, verbose: bool) -> ContractCheck:
        removal = contract_utils.remove_ignored_imports_and_report(
            graph=graph,
            ignore_imports=self.ignore_imports,  # type: ignore[arg-type]
            unmatched_alerting=AlertLevel.ERROR,
        )
        root = str(self.root)
        prefix = root + "."
        ours = sorted(m for m in graph.modules if m == root or m.startswith(prefix))
        cycles: list[list[str]] = []
        seen: set[frozenset[str]] = set()
        for module in ours:
            for imported in sorted(graph.find_modules_directly_imported_by(module)):
                if not (imported == root or imported.startswith(prefix)):
                    continue
                back = graph.find_shortest_chain(importer=imported, imported=module)
                if back is None:
                    continue
                loop = [module, *back]
                key = frozenset(loop)
                if key not in seen:
                    seen.add(key)
                    cycles.append(loop)
        return ContractCheck(
            kept=not cycles,
            warnings=list(removal.warnings),
            ignored_import_count=removal.ignored_import_count,
            metadata={"cycles": cycles},
        )

    def render_broken_contract(self, check: ContractCheck) -> None:
        from importlinter.application import output

        for loop in check.metadata["cycles"]:
            output.print_error(" -> ".join(loop))
            output.new_line()
