defmodule EMLXAxon.DocsTest do
  # Every public function of a documented module says what it does (@doc)
  # and what it takes and gives (@spec); internals are @doc false.
  use ExUnit.Case, async: true

  test "every public function of a documented module has @doc and @spec" do
    {:ok, modules} = :application.get_key(:emlx_axon, :modules)

    problems =
      for module <- Enum.sort(modules),
          {:docs_v1, _, _, _, moduledoc, _, docs} <- [Code.fetch_docs(module)],
          moduledoc != :hidden,
          # Protocol implementations document their protocol instead.
          not impl?(module),
          specs = specs(module),
          {{kind, name, arity}, _, _, doc, _meta} <- docs,
          kind == :function,
          doc != :hidden,
          problem <- [
            doc == :none && "no @doc",
            not MapSet.member?(specs, {name, arity}) && "no @spec"
          ],
          problem do
        "#{inspect(module)}.#{name}/#{arity}: #{problem}"
      end

    assert problems == [], Enum.join(problems, "\n")
  end

  defp impl?(module),
    do: Code.ensure_loaded?(module) and function_exported?(module, :__impl__, 1)

  defp specs(module) do
    case Code.Typespec.fetch_specs(module) do
      {:ok, specs} -> MapSet.new(specs, fn {name_arity, _} -> name_arity end)
      :error -> MapSet.new()
    end
  end
end
