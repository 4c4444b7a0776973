# Kestrel: the two commands a new user needs.
#   make demo   # set up if needed, run the whole stack on the embedded sim (~30 s), print a table
#   make test   # set up if needed, then lint + the test suite (what CI runs)
DURATION ?= 30

.PHONY: setup demo test lint clean
setup:
	bash scripts/setup.sh

demo: setup
	bash scripts/run.sh python scripts/demo.py --duration $(DURATION)

test: setup
	bash scripts/test.sh

lint: setup
	bash scripts/run.sh ruff check .

clean:
	rm -rf ros2_ws/build ros2_ws/install ros2_ws/log ros2_ws/.kestrel_build
