defmodule EMLXAxon.NotebookTest do
  # notebooks/qwen3.livemd keeps running: its Elixir cells, in order, in
  # one binding (as Livebook runs them), against the fixture checkpoint
  # served by a stand-in Hugging Face Hub on 127.0.0.1 (QWEN3_MODEL=hf:...).
  # Only the Mix.install cell is left out (this project is already loaded);
  # the Nx.Serving section's cells need Nx and run only where it is, with
  # Kino.start_child/1 stubbed where Kino is absent.
  use ExUnit.Case, async: false

  import ExUnit.CaptureIO

  alias EMLXAxon.{TestFixtures, TestHub}

  @moduletag :fixtures
  @moduletag :capture_log
  @moduletag timeout: 300_000

  @notebook Path.join(TestFixtures.root(), "notebooks/qwen3.livemd")
  @repo "test-org/notebook-qwen3"

  # [{section, code}] for every ```elixir block.
  defp cells do
    @notebook
    |> File.read!()
    |> String.split(~r/^## /m)
    |> Enum.flat_map(fn section ->
      [heading | _] = String.split(section, "\n", parts: 2)

      for [code] <- Regex.scan(~r/^```elixir\n(.*?)^```$/ms, section, capture: :all_but_first),
          do: {heading, code}
    end)
  end

  defp needs_nx?({heading, _code}), do: heading =~ "Nx.Serving"

  test "the notebook's cells run in order against a Hub checkpoint" do
    hub = TestHub.start!()
    cache = Path.join(System.tmp_dir!(), "emlx_axon_nb_#{System.unique_integer([:positive])}")
    TestHub.put_repo(hub, @repo, TestFixtures.path("qwen3-4bit-g64"))

    vars = %{
      "QWEN3_MODEL" => "hf:" <> @repo,
      "HF_ENDPOINT" => hub.url,
      "EMLX_AXON_CACHE_DIR" => cache
    }

    saved = Map.new(vars, fn {var, _} -> {var, System.get_env(var)} end)
    System.put_env(vars)

    on_exit(fn ->
      for {var, value} <- saved,
          do: if(value, do: System.put_env(var, value), else: System.delete_env(var))

      TestHub.stop(hub)
      File.rm_rf!(cache)
    end)

    [{_, install} | cells] = cells()
    assert install =~ "Mix.install("
    refute Enum.any?(cells, fn {_, code} -> code =~ "Mix.install(" end)

    {cells, left_out} =
      if Code.ensure_loaded?(Nx.Serving),
        do: {cells, []},
        else: Enum.split_with(cells, &(not needs_nx?(&1)))

    if left_out != [] do
      IO.puts(
        :stderr,
        "notebook: #{length(left_out)} Nx.Serving cells left out (Nx is not available)"
      )
    end

    if Code.ensure_loaded?(Nx.Serving) and not Code.ensure_loaded?(Kino), do: stub_kino!()

    # Every section but the Nx one runs here, whatever is installed.
    assert length(cells) >= 9

    # The binding and the environment (aliases) carry from cell to cell.
    env = Code.env_for_eval(file: @notebook)

    {{binding, _env}, output} =
      with_io(fn ->
        cells
        |> Enum.with_index(1)
        |> Enum.reduce({[], env}, fn {{heading, code}, index}, {binding, env} ->
          quoted = Code.string_to_quoted!(code, file: @notebook)

          try do
            {_result, binding, env} = Code.eval_quoted_with_env(quoted, binding, env)
            {binding, env}
          rescue
            error ->
              flunk(
                "cell #{index} (section #{heading}) raised:\n" <>
                  Exception.format(:error, error, __STACKTRACE__) <> "\n" <> code
              )
          end
        end)
      end)

    # The model came from the Hub, through the cache.
    assert binding[:model] == {:hf, @repo}
    assert %EMLXAxon.Qwen3.Model.State{path: path} = binding[:state]
    assert String.starts_with?(path, cache)
    assert %EMLXAxon.Tokenizer{} = binding[:tokenizer]
    assert output =~ "MLX: %{"
  end

  defp stub_kino! do
    {:ok, sup} =
      DynamicSupervisor.start_link(strategy: :one_for_one, name: EMLXAxon.NotebookTest.Kino)

    Code.compile_string("""
    defmodule Kino do
      def start_child(spec), do: DynamicSupervisor.start_child(#{inspect(sup)}, spec)
    end
    """)
  end
end
