# The tests run against the real NIF and the fixtures that scripts/setup
# builds in .cache/fixtures. Tests that need the fixtures are tagged
# :fixtures; without the fixtures they are excluded, loudly.
exclude =
  if EMLXAxon.TestFixtures.available?() do
    []
  else
    IO.puts(:stderr, """
    \e[33mThe test fixtures are missing from #{EMLXAxon.TestFixtures.fixtures_dir()}: \
    run scripts/setup to build them. Tests tagged :fixtures are excluded.\e[0m
    """)

    [:fixtures]
  end

ExUnit.start(exclude: exclude)
