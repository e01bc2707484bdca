"""Adds up pytest JUnit reports: prints 'N passed, N failed, N skipped'; exits 1 if no test ran."""

import sys
import xml.etree.ElementTree as ET

passed = failed = skipped = 0
for path in sys.argv[1:]:
    for suite in ET.parse(path).getroot().iter("testsuite"):
        tests, fail = int(suite.get("tests", 0)), int(suite.get("failures", 0)) + int(suite.get("errors", 0))
        skip = int(suite.get("skipped", 0))
        passed += tests - fail - skip
        failed += fail
        skipped += skip
print(f"total: {passed} passed, {failed} failed, {skipped} skipped")
if passed + failed == 0:
    print("error: no test ran", file=sys.stderr)
    sys.exit(1)
sys.exit(1 if failed else 0)
